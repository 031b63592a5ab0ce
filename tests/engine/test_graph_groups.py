"""Which decode graph a LoRA step replays (`cuda_graphs.graph_groups`): its own group set, or the bucket's
every-group graph for an uncommon set, so serving never stops to capture one."""
from compute_service.engine.cuda_graphs import WARM_GROUPS, graph_groups
from compute_service.engine.lora_backend import ALL_GROUPS

QKV = frozenset({"qkv"})
ODD = frozenset({"qkv", "gate_up"})


def test_own_set_when_captured_or_warm():
    assert QKV in WARM_GROUPS and ALL_GROUPS in WARM_GROUPS
    captured = {(8, ALL_GROUPS): None, (8, ODD): None}
    assert graph_groups(8, ODD, captured) == ODD                   # already captured: its own graph
    assert graph_groups(8, QKV, captured) == QKV                   # a warm-up set: captured if missing
    assert graph_groups(8, ALL_GROUPS, {}) == ALL_GROUPS


def test_uncommon_set_replays_the_every_group_graph_where_there_is_one():
    assert graph_groups(8, ODD, {(8, ALL_GROUPS): None}) == ALL_GROUPS
    assert graph_groups(16, ODD, {(8, ALL_GROUPS): None}) == ODD   # that bucket has none: capture its own
    assert graph_groups(8, frozenset(), {(8, ALL_GROUPS): None}) == ALL_GROUPS
