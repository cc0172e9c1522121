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
