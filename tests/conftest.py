"""Session-wide test settings."""

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny tensors run fastest on one thread, and tests share the machine's cores; set
    for every test, since code under test may change it (training sets `threads`)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node Slurm cluster shared by the whole session, started on first use and
    stopped at its end (see `cat.testing.slurm`); skips when Slurm cannot run here.
    `SLURM_CONF` points every Slurm client at it meanwhile, so code under test that calls
    `sbatch` finds it."""
    from cat.testing.slurm import slurm_cluster as start_cluster
    from cat.testing.slurm import slurm_unavailable

    reason = slurm_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with (start_cluster(tmp_path_factory.mktemp("slurm")) as cluster,
          pytest.MonkeyPatch.context() as patch):
        patch.setenv("SLURM_CONF", str(cluster.conf))
        yield cluster
