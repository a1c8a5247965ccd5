import pytest
import torch

from meshrl.testing.tiny_model import make_tiny_model_dir
from services.trainer.distributed import World, init_distributed


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Hidden 32, 2 layers: a few thousand parameters, fast on CPU."""
    path = tmp_path_factory.mktemp("tiny_model")
    return make_tiny_model_dir(path, seed=0, hidden=32, layers=2, heads=2, intermediate=64)


@pytest.fixture(scope="session")
def world():
    """A one-rank gloo world in the test process (FSDP code paths need one)."""
    torch.set_num_threads(1)
    init_distributed()
    return World.current("cpu")
