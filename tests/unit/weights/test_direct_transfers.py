"""Large tensors move straight from and into their own storage; mismatched ones through a bucket buffer; all exact,
each live target reported landed once its bytes are all in place."""

from __future__ import annotations

import io
import multiprocessing as mp
import traceback

import torch

from dockyard.weights import collective
from dockyard.weights.collective import TensorSink, receive_weights, send_weights
from dockyard.weights.group import GroupMember, WeightSyncGroup
from dockyard.weights.refit import TensorSpec
from tests.unit.weights.test_collective import run_pair

BUCKET = 1024  # bytes: the 64x48 float32 tensors span several buckets
DIRECT = 512  # tensors of at least this many bytes go direct


def test_copy_flat_reads_and_writes_any_element_range_of_a_strided_tensor() -> None:
    base = torch.arange(5 * 7 * 6, dtype=torch.float32).view(5, 7, 6)
    strided = base.transpose(0, 2)[:, 1:]  # not contiguous, shape (6, 6, 5)
    reference = strided.reshape(-1)
    for a, b in [(0, reference.numel()), (3, 4), (7, 61), (29, 150), (30, 60), (179, 180)]:
        out = torch.empty(b - a, dtype=torch.float64)
        collective.copy_flat(strided, a, b, out, into_flat=True)
        assert torch.equal(out, reference[a:b].double())
        target = torch.zeros(6, 5, 6, dtype=torch.bfloat16).transpose(1, 2)  # strided target, shape (6, 6, 5)
        collective.copy_flat(target, a, b, reference[a:b], into_flat=False)
        written = target.reshape(-1)
        assert torch.equal(written[a:b], reference[a:b].to(torch.bfloat16))
        assert not written[:a].any() and not written[b:].any()


def test_transfer_plan_packs_small_tensors_first_and_cuts_large_ones_into_buckets() -> None:
    specs = [
        TensorSpec("a", (300,), "float32"),  # 1200 B: direct, two transfers
        TensorSpec("b", (3,), "bfloat16"),  # packed
        TensorSpec("c", (128,), "float32"),  # 512 B: direct, one transfer
        TensorSpec("d", (100,), "float32"),  # packed
    ]
    plan = collective.transfer_plan(specs, BUCKET, DIRECT)
    assert plan.packed == [1, 3]
    moved = [(t.index, t.lo, t.hi) for t in plan.transfers]
    assert moved == [(-1, 0, 64 + 400), (0, 0, 1024), (0, 1024, 1200), (2, 0, 512)]
    assert all(t.hi - t.lo <= BUCKET for t in plan.transfers)
    everything_packed = collective.transfer_plan(specs, BUCKET, 0)
    assert {t.index for t in everything_packed.transfers} == {-1}


def _sent() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        ("large.contiguous", torch.randn(64, 48, generator=gen)),
        ("small.a", torch.randn(5, generator=gen).to(torch.bfloat16)),
        ("large.strided", torch.randn(40, 33, generator=gen).t()),  # not contiguous on the sender
        ("large.cast", torch.randn(30, 20, generator=gen).to(torch.bfloat16)),  # float32 on the engine
        ("large.target_strided", torch.randn(24, 16, generator=gen)),  # a strided live target on the engine
        ("small.b", torch.randn(3, 2, generator=gen)),
    ]


def _targets() -> dict[str, torch.Tensor]:
    targets = {name: torch.zeros_like(t, memory_format=torch.contiguous_format) for name, t in _sent()}
    targets["large.cast"] = torch.zeros(30, 20, dtype=torch.float32)
    targets["large.target_strided"] = torch.zeros(16, 24).t()
    return targets


def _member(rank: int, port: int, out: mp.Queue) -> None:
    try:
        member = GroupMember(WeightSyncGroup("127.0.0.1", port, 2, rank, epoch=1, secret="shared by both ranks"))
        if rank == 0:
            first = send_weights(member, _sent(), BUCKET, direct_bytes=DIRECT)
            second = send_weights(member, _sent(), BUCKET, direct_bytes=DIRECT)
            member.close()
            out.put((rank, "ok", (first.checksum, second.checksum), None, None))
            return
        copied: set[int] = set()  # storages the receiver copied into (not written by the broadcast itself)
        copy_flat = collective.copy_flat

        def recording(t, a, b, flat, into_flat):
            if not into_flat:
                copied.add(t.untyped_storage().data_ptr())
            copy_flat(t, a, b, flat, into_flat)

        collective.copy_flat = recording
        targets = _targets()
        pointers = {name: t.untyped_storage().data_ptr() for name, t in targets.items()}
        landings: list[tuple[str, torch.Tensor]] = []  # each landed target, as it was when reported

        def landed(names: list[str]) -> None:
            landings.extend((name, targets[name].clone()) for name in names)

        first = receive_weights(member, TensorSink(targets=targets, landed=landed))
        loaded: dict[str, torch.Tensor] = {}
        second = receive_weights(member, TensorSink(load=lambda items: loaded.update(items)))
        member.close()
        copied_names = sorted(name for name, ptr in pointers.items() if ptr in copied)
        received = io.BytesIO()
        # Tensors through a queue would share memory with an exited process.
        torch.save((targets, loaded, landings), received)
        out.put((rank, "ok", (first.checksum, second.checksum), received.getvalue(), copied_names))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", f"{type(exc).__name__}: {exc}", traceback.format_exc(), None))


def test_mixed_tensors_arrive_exactly_through_the_direct_and_the_buffered_paths() -> None:
    results = run_pair(_member)
    assert results[0][0] == "ok" and results[1][0] == "ok", results
    sent_checksums, (got_checksums, received, copied) = results[0][1], results[1][1:]
    targets, loaded, landings = torch.load(io.BytesIO(received))
    assert got_checksums == sent_checksums and all(len(c) == 64 for c in sent_checksums)
    sent = dict(_sent())
    for name, tensor in sent.items():
        # live targets: exact, cast to the engine's dtype where it differs
        assert targets[name].dtype == (torch.float32 if name == "large.cast" else tensor.dtype)
        assert torch.equal(targets[name], tensor.to(targets[name].dtype)), name
        # a whole-tensor loader gets each tensor once, in the sender's dtype and shape
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert not targets["large.target_strided"].is_contiguous()
    # Each live target was reported landed once, whichever path it took, and only when all its bytes were in
    # place (the large ones span several transfers).
    assert sorted(name for name, _ in landings) == sorted(sent)
    for name, then in landings:
        assert torch.equal(then, sent[name].to(then.dtype)), name
    # Only the packed small tensors and the two mismatched large ones were copied out of a buffer;
    # the matching large tensors (contiguous and strided on the sender) were written by the broadcast itself.
    assert copied == ["large.cast", "large.target_strided", "small.a", "small.b"]
