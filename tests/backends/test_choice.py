"""``ep_comm.backends.choice``: every rank's availability merged into one answer per backend."""
from ep_comm.backends.choice import UNKNOWN, auto_candidates, merge_reasons


def test_merge_reasons_one_reason_when_every_rank_agrees_else_each_reason_once_with_its_ranks():
    merged = merge_reasons([
        {"naive": "", "mnnvl": "no GPU", "nvshmem": "no heap", "ag_rs": "no gloo"},
        {"naive": "", "mnnvl": "no GPU", "nvshmem": "", "ag_rs": "no gloo"},
        {"naive": "", "mnnvl": "no GPU", "ag_rs": "no gloo"},
        {"naive": "", "mnnvl": "no GPU", "nvshmem": "", "ag_rs": ""},
    ])
    assert merged == {"naive": "", "mnnvl": "no GPU", "nvshmem": f"rank 0: no heap; rank 2: {UNKNOWN}",
                      "ag_rs": "ranks 0-2: no gloo"}
    assert auto_candidates(merged) == []
    assert auto_candidates({**merged, "ag_rs": "", "nvshmem": ""}) == ["nvshmem", "ag_rs"]
