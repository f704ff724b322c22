"""``Dispatched.filled``: the fields a layout always fills, or a typed error naming the missing one."""
import pytest
import torch

from ep_comm import EPInputError
from ep_comm.layouts import Dispatched


def test_filled_returns_the_field_or_names_what_is_missing():
    counts = torch.randint(0, 5, (3,), dtype=torch.int32)
    d = Dispatched(layout="batched", x=torch.randn(3, 4, 8), expert_num_tokens=counts)
    assert d.filled("expert_num_tokens") is counts
    with pytest.raises(EPInputError, match=r"Dispatched\.topk_ids is missing: a batched dispatch"):
        d.filled("topk_ids")
