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


def test_graph_for_finds_the_base_graph_and_the_last_lora_steps():
    """The benchmarks' lookup (`time_replay`, the tensor-parallel profile): a LoRA graph is keyed by its
    group set, so it is the bucket's last LoRA step's graph that is timed."""
    from compute_service.engine.cuda_graphs import DecodeGraphs

    g = object.__new__(DecodeGraphs)          # the lookup only: no model, no CUDA graph pool
    g.buckets = [1, 2, 4, 8]
    g._graphs = {(8, None): ("base", None), (8, QKV): ("qkv", None), (8, ALL_GROUPS): ("all", None)}
    g._last_lora_key = {8: (8, QKV)}
    assert g.graph_for(5, False) == "base"
    assert g.graph_for(5, True) == "qkv"
    assert g.graph_for(1, True) is None and g.graph_for(1, False) is None     # bucket 1 not captured
    assert g.graph_for(9, False) is None                                      # beyond the largest bucket
