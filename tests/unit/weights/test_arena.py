"""Parameter arenas and merged copies: packing keeps every value, and a sync between two arenas of one
layout is one copy."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from dockyard.weights import arena
from dockyard.weights.collective import TensorSink
from dockyard.weights.colocated import ColocatedTransport
from dockyard.weights.group import WeightSyncGroup
from dockyard.weights.handles import new_shared_file, remove_file, shared_file_of
from tests.conftest import free_port


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 11, bias=False)
    )
    model[3].weight = model[0].weight  # tied, as a language model's head and embeddings are
    return model


def test_pack_keeps_values_names_and_ties_and_puts_every_parameter_in_one_storage() -> None:
    model = _model(0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    assert not arena.is_packed(model)
    buffer = arena.pack(model)
    assert arena.is_packed(model)
    assert list(model.parameters()) == params  # the same Parameter objects: an optimizer's keys hold
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value) and after[name].requires_grad, name
        assert after[name].data_ptr() % arena.ALIGN == 0, name
    assert model[3].weight is model[0].weight  # still tied, stored once
    assert buffer.numel() >= sum(p.numel() * p.element_size() for p in params)
    with torch.no_grad():
        buffer.zero_()
    assert all(float(p.detach().abs().sum()) == 0 for p in model.parameters())  # views of the arena, not copies


def test_pack_refuses_parameters_on_two_devices() -> None:
    model = _model(0)
    model[1].weight = torch.nn.Parameter(torch.empty(8, 8, device="meta"))
    with pytest.raises(ValueError, match="one device"):
        arena.pack(model)


def test_pack_refuses_an_arena_too_small_or_of_another_dtype() -> None:
    for short in (lambda n: torch.empty(n - 1, dtype=torch.uint8), lambda n: torch.empty(n, dtype=torch.int8)):
        with pytest.raises(ValueError, match="bytes of uint8"):
            arena.pack(_model(0), short)


def test_aliases_are_the_same_objects_until_a_parameter_moves() -> None:
    model = _model(2)
    arena.pack(model)
    aliases = arena.Aliases(model)
    first = aliases.get()
    assert [n for n, _ in first] == [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        model[1].weight.add_(1.0)  # an optimizer step, in place
    again = aliases.get()
    assert all(a is b for (_, a), (_, b) in zip(first, again, strict=True))
    assert torch.equal(dict(again)["1.weight"], model[1].weight) and not dict(again)["1.weight"].requires_grad
    model[1].weight.data = torch.zeros(8, 8)  # moved out of the arena
    moved = dict(aliases.get())
    assert moved["1.weight"] is not dict(first)["1.weight"]
    assert moved["1.weight"].data_ptr() == model[1].weight.data_ptr()
    assert torch.equal(moved["1.weight"], torch.zeros(8, 8))


def test_coalesce_merges_exact_adjacency_on_both_sides_only() -> None:
    src, dst = torch.arange(40, dtype=torch.float32), torch.zeros(40)
    pairs = [(dst[0:10], src[0:10]), (dst[20:30], src[20:30]), (dst[10:20], src[10:20]), (dst[31:40], src[30:39])]
    dsts, srcs = arena.coalesce([d for d, _ in pairs], [s for _, s in pairs])
    assert len(dsts) == 2  # [0, 30) in one copy; the last pair is shifted on one side: alone
    for d, s in zip(dsts, srcs, strict=True):
        d.copy_(s)
    expected = torch.zeros(40)
    expected[:30] = src[:30]
    expected[31:40] = src[30:39]
    assert torch.equal(dst, expected)
    other = torch.zeros(10)  # adjacent addresses in another storage never merge
    dsts, _ = arena.coalesce([dst[0:10], other], [src[0:10], src[10:20]])
    assert len(dsts) == 2


def test_a_sync_between_two_arenas_of_one_layout_is_one_copy() -> None:
    trainer, engine = _model(1), _model(2)
    shared = arena.pack(trainer, new_shared_file)  # shared as it is, as a GPU's memory is
    arena.pack(engine)
    sent = [(n, p.detach()) for n, p in trainer.named_parameters()]
    targets = {n: p.data for n, p in engine.named_parameters()}
    sender = ColocatedTransport(timedelta(seconds=10), 1 << 20, checksum=False)
    receiver = ColocatedTransport(timedelta(seconds=10), 1 << 20, checksum=False)
    port = free_port()

    def group(rank: int) -> WeightSyncGroup:
        return WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=1, secret="s")

    try:
        for version in (1, 2):
            with torch.no_grad():
                for _, t in sent:
                    t.add_(1.0)
            thread = threading.Thread(target=receiver.receive, args=(TensorSink(targets=targets), version, group(1)))
            thread.start()
            sender.send(sent, version, group(0))
            thread.join(30)
            for name, t in sent:
                assert torch.equal(targets[name], t), (version, name)
        replay = receiver.peer.replay[2]
        assert len(replay.dsts) == 1 and replay.dsts[0].numel() == sum(t.nbytes for _, t in sent)
    finally:
        sender.close()
        receiver.close()
        remove_file(shared_file_of(shared))
