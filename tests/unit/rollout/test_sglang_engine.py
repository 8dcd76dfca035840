"""The SGLang engine's translation, against a stand-in `sglang` module; real SGLang is not run here.

SGLang cannot run on this machine: sglang 0.5.23 pins torch 2.14.1 (this
environment has another torch) and needs CUDA kernels (sglang-kernel,
flashinfer) and a GPU. So these tests check the adapter against a stand-in
that implements the documented surface it uses — `sglang.Engine(**server_args)`,
`async_generate(input_ids=..., sampling_params=..., return_logprob=True)` with
SGLang's result layout, the tokenizer manager's weight-update coroutines and
the io_struct request classes — and nothing about SGLang's own behaviour
(its sampler's logprobs, its stop-string matching, its model loading).

What is real: the job-config translation, the prompt and sampling
translation, the result mapping, the refusals (image prompts, truncation,
seeds without deterministic inference, token ids outside the vocabulary),
and the whole-tensor weight sync on both sides: dockyard's own sender
(WholeTensorTransport, in a child process, as the trainer runs it), a real
TCPStore, dockyard's real secret proof, the bucket manifests in the store, and
real gloo broadcasts into the stand-in's process group, which it forms with
the torch calls SGLang's init_custom_process_group makes. The stand-in lives
in tests/fixtures/sglang_stand_in (the integration test
tests/integration/test_sglang_weight_sync.py runs it inside a rollout service).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from PIL import Image

from dockyard.config import load_config_text
from dockyard.models import build_char_tokenizer
from dockyard.rpc.errors import FailedPrecondition, InvalidArgument
from dockyard.weights.group import SyncFailed, WeightSyncGroup
from dockyard.weights.group_source import transport_for
from dockyard.weights.transports import CheckpointTransport, CollectiveTransport
from dockyard.weights.whole_tensor import WholeTensorTransport, bucket_key, buckets, decode_bucket, loaded_key, scoped
from services.rollout.decoding import DecodingParams
from services.rollout.engine import ImagePrompt, UnsupportedRequest
from services.rollout.sglang_engine import (
    SglangEngine,
    SglangUnavailable,
    completion_from_sglang,
    engine_arguments,
    import_sglang,
    sample_seed,
)
from tests.conftest import free_port

TIMEOUT = timedelta(seconds=20)


def _config(model_dir: str, in_flight: bool = False, transport: str = "collective", **sglang_cfg) -> object:
    import yaml

    data = {
        "policy": {
            "model_name": model_dir,
            "dtype": "bfloat16",
            "generation": {"backend": "sglang", "sglang_cfg": sglang_cfg},
        },
        "cluster": {"device": "cuda", "weight_sync_backend": "nccl", "weight_sync_transport": transport},
        "grpo": {"seed": 5, "async_grpo": {"in_flight_weight_updates": in_flight}},
    }
    return load_config_text(yaml.safe_dump(data))


# -- the stand-in -------------------------------------------------------------

STAND_IN = Path(__file__).resolve().parents[2] / "fixtures" / "sglang_stand_in"


def _stand_in_sglang(monkeypatch) -> None:
    """Make the stand-in `sglang` importable for this test only (monkeypatch forgets its modules afterwards)."""
    monkeypatch.syspath_prepend(str(STAND_IN))
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.io_struct"):
        monkeypatch.setitem(sys.modules, name, None)  # undone last: the entry as it was before the test
        monkeypatch.delitem(sys.modules, name)
    import sglang

    assert Path(sglang.__file__).is_relative_to(STAND_IN)


@pytest.fixture()
def model_dir(tmp_path) -> str:
    build_char_tokenizer().save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


# -- configuration and refusal --------------------------------------------------


def test_missing_sglang_is_a_failed_precondition_naming_the_package(monkeypatch, model_dir) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang raises ImportError
    with pytest.raises(SglangUnavailable, match="pip install sglang"):
        import_sglang()

    from dockyard.api.rollout.v1 import rollout_pb2
    from services.rollout.servicer import RolloutServicer
    from services.rollout.settings import RolloutSettings

    async def load():
        servicer = RolloutServicer(RolloutSettings(device="cuda"))  # where the job's cluster.device says
        try:
            config = _config(model_dir).resolved_yaml()
            await servicer.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="j", config_yaml=config), None)
        finally:
            await servicer.close()

    with pytest.raises(FailedPrecondition, match="backend=sglang: SGLang is not importable"):
        asyncio.run(load())


def test_job_config_becomes_server_arguments(model_dir) -> None:
    arguments = engine_arguments(_config(model_dir, mem_fraction_static=0.5, enable_deterministic_inference=True))
    assert arguments == {
        "model_path": model_dir,
        "dtype": "bfloat16",
        "random_seed": 5,
        "mem_fraction_static": 0.5,
        "enable_deterministic_inference": True,
    }
    with pytest.raises(ValueError, match="tokenizer_path is set by the engine"):
        engine_arguments(_config(model_dir, tokenizer_path="/elsewhere"))
    with pytest.raises(ValueError, match="sglang_cfg.tp_size"):
        engine_arguments(_config(model_dir, tp_size=2))
    with pytest.raises(ValueError, match="in_flight_weight_updates"):
        engine_arguments(_config(model_dir, in_flight=True))
    with pytest.raises(InvalidArgument, match="in_flight_weight_updates"):  # at load, before SGLang is imported
        asyncio.run(SglangEngine.create(_config(model_dir, in_flight=True), "cuda"))
    with pytest.raises(ValueError, match="cluster.weight_sync_transport"):
        engine_arguments(_config(model_dir, transport="checkpoint"))


def test_an_sglang_job_syncs_whole_tensors_and_others_do_not(model_dir) -> None:
    """transport_for is the one place that picks the protocol, for the trainer and the replicas alike."""
    sglang_job = transport_for(_config(model_dir), "j", TIMEOUT, "cuda")
    assert isinstance(sglang_job, WholeTensorTransport) and sglang_job.bucket_bytes == 256 * 2**20
    torch_job = load_config_text("policy: {model: {model_type: qwen2}}")
    assert isinstance(transport_for(torch_job, "j", TIMEOUT), CollectiveTransport)
    assert isinstance(transport_for(_config(model_dir, transport="checkpoint"), "j", TIMEOUT), CheckpointTransport)


# -- generation -------------------------------------------------------------------


def test_prompts_sampling_and_results_translate(monkeypatch, model_dir) -> None:
    _stand_in_sglang(monkeypatch)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "true")

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir, context_length=64), "cuda")
        sgl = engine.engine
        assert sgl.kwargs["context_length"] == 64 and sgl.kwargs["model_path"] == model_dir
        assert sgl.original_logprob_env == "false"  # SGLang's scheduler would see pre-temperature logprobs

        decoding = DecodingParams(temperature=0.7, max_new_tokens=9, stop=("b",), ignore_eos=True)
        result = await engine.generate("1+2=", 3, decoding)
        ids = engine.tokenizer("1+2=")["input_ids"]
        request = sgl.requests[0]
        assert request["input_ids"] == [ids, ids, ids] and request["return_logprob"] is True
        assert request["image_data"] is None
        assert (
            request["sampling_params"]
            == [
                {
                    "temperature": 0.7,
                    "top_p": 1.0,
                    "top_k": -1,
                    "min_p": 0.0,
                    "frequency_penalty": 0.0,
                    "presence_penalty": 0.0,
                    "repetition_penalty": 1.0,
                    "max_new_tokens": 9,
                    "stop": ["b"],
                    "no_stop_trim": True,
                    "ignore_eos": True,
                    "skip_special_tokens": True,
                }
            ]
            * 3
        )
        assert result.prompt_token_ids == ids
        assert [c.finish_reason for c in result.completions] == ["length", "eos", "stop"]
        first = result.completions[0]
        assert first.token_ids == [ids[0], 7] and first.logprobs == [-0.5, -1.25]
        assert first.text == engine.tokenizer.decode([ids[0], 7], skip_special_tokens=True)  # our decode, not SGLang's
        assert result.weight_versions == [0]

        # Token ids go to SGLang exactly as given (here with a bos the tokenizer would not add).
        given = [2, 9, 9, 1]
        assert (await engine.generate(given, 1, DecodingParams())).prompt_token_ids == given
        assert sgl.requests[-1]["input_ids"] == [given]

        refused = {
            "prompt_token_ids": lambda: engine.generate([5, len(engine.tokenizer)], 1, DecodingParams()),
            "image and other multimodal": lambda: engine.generate({"image": b"\x89PNG"}, 1, DecodingParams()),
            "images: the SGLang engine takes no image inputs": lambda: engine.generate(
                ImagePrompt(text="x", images=(Image.new("RGB", (4, 4)),)), 1, DecodingParams()
            ),
            "not bytes": lambda: engine.generate(b"\x89PNG", 1, DecodingParams()),
            "sampling.top_p": lambda: engine.generate("1", 1, DecodingParams(top_p=0.9)),
            "sampling.top_k": lambda: engine.generate("1", 1, DecodingParams(top_k=4)),
            "sampling.seed": lambda: engine.generate("1", 1, DecodingParams(seed=3)),
            "top_logprobs: the SGLang engine": lambda: engine.generate("1", 1, DecodingParams(top_logprobs=2)),
        }
        assert "SGLang engine takes no image inputs" in engine.image_refusal  # the servicer's FAILED_PRECONDITION
        before = len(sgl.requests)
        for words, call in refused.items():
            with pytest.raises(UnsupportedRequest, match=words):
                await call()
        assert len(sgl.requests) == before  # nothing refused reached SGLang
        await engine.close()
        assert sgl.shut

    asyncio.run(scenario())


def test_seeds_need_deterministic_inference_and_differ_per_sample(monkeypatch, model_dir) -> None:
    _stand_in_sglang(monkeypatch)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir, enable_deterministic_inference=True), "cuda")
        await engine.generate("1+2=", 3, DecodingParams(seed=11))
        seeds = [p["sampling_seed"] for p in engine.engine.requests[0]["sampling_params"]]
        assert seeds == [sample_seed(11, i) for i in range(3)] and len(set(seeds)) == 3
        assert all(0 <= s < 2**63 for s in seeds) and sample_seed(12, 0) != seeds[0]

    asyncio.run(scenario())


def test_a_cancelled_generation_reaches_sglang(monkeypatch, model_dir) -> None:
    _stand_in_sglang(monkeypatch)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir), "cuda")
        engine.engine.release.clear()
        generating = asyncio.create_task(engine.generate("1+2=", 1, DecodingParams()))
        while not engine.engine.requests:
            await asyncio.sleep(0)
        generating.cancel()
        await asyncio.gather(generating, return_exceptions=True)
        assert generating.cancelled() and engine.engine.cancelled == 1
        assert engine._active == 0  # a weight load no longer waits for it

    asyncio.run(scenario())


def test_results_that_do_not_fit_are_errors_not_guesses() -> None:
    tokenizer = build_char_tokenizer()
    abort = {"output_ids": [], "meta_info": {"output_token_logprobs": [], "finish_reason": {"type": "abort"}}}
    with pytest.raises(RuntimeError, match="abort"):
        completion_from_sglang(abort, tokenizer, (0,))
    misaligned = {
        "output_ids": [5, 6],
        "meta_info": {"output_token_logprobs": [(-1.0, 5, None)], "finish_reason": {"type": "length"}},
    }
    with pytest.raises(RuntimeError, match="line up"):
        completion_from_sglang(misaligned, tokenizer, (0,))


# -- weight sync ------------------------------------------------------------------------


def _trainer_process(conn, timeout_s: float, bucket_bytes: int) -> None:
    """Rank 0 in its own process (torch's process-group names are per process): one send per message."""
    transport = WholeTensorTransport(timedelta(seconds=timeout_s), bucket_bytes)
    conn.send("ready")
    while (job := conn.recv()) is not None:
        version, tensors, group = job
        try:
            report = transport.send(tensors, version, group)
            conn.send(("ok", report.checksum, report.num_bytes, transport.sender is not None))
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            conn.send((type(exc).__name__, str(exc), transport.sender is not None))
    transport.close()


class _Trainer:
    """dockyard's own whole-tensor sender, as the trainer runs it, in a child process."""

    def __init__(self, timeout: timedelta = TIMEOUT, bucket_bytes: int = 100) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_trainer_process, args=(child, timeout.total_seconds(), bucket_bytes), daemon=True
        )
        self.process.start()
        # Started (imports done) before the replica's timeouts run: this machine may be slow to spawn.
        assert self.conn.poll(300) and self.conn.recv() == "ready", "the trainer process did not start"

    def send(self, version: int, tensors: list[tuple[str, torch.Tensor]], group: WeightSyncGroup) -> None:
        self.conn.send((version, tensors, replace(group, rank=0)))

    async def outcome(self) -> tuple:
        """("ok", checksum, bytes, sender kept) or (error type, message, sender kept) of the last send."""

        def receive():
            assert self.conn.poll(60), "the trainer process did not answer"
            return self.conn.recv()

        return await asyncio.to_thread(receive)

    def close(self) -> None:
        self.conn.send(None)
        self.process.join(30)


def test_buckets_hold_whole_tensors_in_order_and_a_larger_tensor_alone() -> None:
    tensors = [("module.a", torch.zeros(10)), ("b", torch.zeros(30)), ("c", torch.zeros(5)), ("d", torch.zeros(5))]
    got = [([n for n, _ in bucket], last) for bucket, last in buckets(tensors, bucket_bytes=64)]
    assert got == [(["a"], False), (["b"], False), (["c", "d"], True)]  # checkpoint names; b is 120 bytes
    manifest = {"version": 3, "index": 1, "last": True, "tensors": [["a", "float32", [2]]]}
    assert decode_bucket(json.dumps(manifest).encode(), 3, 1) == ([("a", "float32", [2])], True)
    with pytest.raises(SyncFailed, match="bucket 0 of version 3 is malformed: it is bucket 1"):
        decode_bucket(json.dumps(manifest).encode(), 3, 0)
    with pytest.raises(SyncFailed, match="bad dtype 'nonsense'"):
        decode_bucket(json.dumps({**manifest, "tensors": [["a", "nonsense", [2]]]}).encode(), 3, 1)


def _group(epoch: int = 1, secret: str = "s3cret") -> WeightSyncGroup:
    return WeightSyncGroup("127.0.0.1", free_port(), 2, 1, epoch, "gloo", secret=secret)


def test_weights_arrive_over_the_store_and_sglangs_group(monkeypatch, model_dir) -> None:
    _stand_in_sglang(monkeypatch)
    group = _group()
    transport = WholeTensorTransport(TIMEOUT, bucket_bytes=1 << 20)  # the replica's: only picks the protocol
    embed, head = torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(6, 4)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir), "cuda")
        manager = engine.engine.tokenizer_manager
        manager.weights = {"model.embed.weight": torch.zeros(6, 4), "lm_head.weight": torch.zeros(6, 4)}
        trainer = _Trainer()  # 100-byte buckets: one tensor each
        trainer.send(2, [("_orig_mod.model.embed.weight", embed), ("lm_head.weight", head)], group)

        engine.engine.release.clear()  # a generation running: the load waits for it
        generating = asyncio.create_task(engine.generate("1+2=", 1, DecodingParams()))
        await asyncio.sleep(0.05)
        loading = asyncio.create_task(engine.receive_weights(transport, 2, group, TIMEOUT))
        await asyncio.sleep(0.2)
        assert not loading.done() and manager.calls == []
        engine.engine.release.set()
        assert (await generating).weight_version == 0
        report = await loading
        assert await trainer.outcome() == ("ok", "", 6 * 4 * 2 + 6 * 4 * 4, True)
        # The version's manifests and acknowledgements are gone once it is sent: the same version sent
        # again is read from its new keys, never from one rank 0 deletes between a replica's wait and get.
        store = scoped(dist.TCPStore(group.master_address, group.master_port, is_master=False, timeout=TIMEOUT), 1)
        assert not store.check([bucket_key(2, 0)]) and not store.check([loaded_key(2, 1)])

        init, first, last = manager.calls
        name = f"dockyard-{group.master_port}-epoch-1"
        assert (init.rank_offset, init.world_size, init.group_name, init.backend) == (1, 2, name, "gloo")
        # Checkpoint names (wrappers removed), the sender's dtypes and shapes, one call per bucket.
        assert (first.names, first.dtypes, first.shapes) == (["model.embed.weight"], ["bfloat16"], [[6, 4]])
        assert (last.names, last.dtypes) == (["lm_head.weight"], ["float32"])
        assert (first.flush_cache, last.flush_cache, last.weight_version) == (False, True, "2")
        assert torch.equal(manager.weights["model.embed.weight"], embed.float())
        assert torch.equal(manager.weights["lm_head.weight"], head)
        assert engine.weight_version == 2 and report.num_bytes == 6 * 4 * 2 + 6 * 4 * 4

        # A name SGLang's model does not know: both sides fail with SGLang's reason, SGLang's group is destroyed.
        trainer.send(3, [("model.nope", torch.zeros(2))], group)
        with pytest.raises(SyncFailed, match="unknown parameter model.nope"):
            await engine.receive_weights(transport, 3, group, TIMEOUT)
        kind, message, kept = await trainer.outcome()
        assert (kind, kept) == ("SyncFailed", False)  # rank 0 closed its group: the next sync forms a new one
        assert "rank 1: failed:" in message and "unknown parameter model.nope" in message
        assert type(manager.calls[-1]).__name__ == "DestroyWeightsUpdateGroupReqInput" and manager.groups == {}
        assert engine.weight_version == 2 and engine.weights.group is None

        # The next epoch (a fresh port, as the coordinator hands out) forms both groups again.
        again = replace(group, epoch=2, master_port=free_port())
        trainer.send(4, [("lm_head.weight", head * 2)], again)
        await engine.receive_weights(transport, 4, again, TIMEOUT)
        assert (await trainer.outcome())[0] == "ok" and torch.equal(manager.weights["lm_head.weight"], head * 2)
        trainer.close()

    asyncio.run(scenario())


def test_a_replica_failing_mid_stream_fails_the_send_with_its_reason(monkeypatch, model_dir) -> None:
    """The replica stops after bucket 0 while rank 0 may be broadcasting bucket 1: rank 0 still says why, bounded."""
    _stand_in_sglang(monkeypatch)
    group = _group(epoch=3)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir), "cuda")
        engine.engine.tokenizer_manager.weights = {"lm_head.weight": torch.zeros(6, 4)}
        trainer = _Trainer(timeout=timedelta(seconds=10))  # bounds its wait in bucket 1's broadcast
        trainer.send(1, [("model.unknown", torch.ones(6, 4)), ("lm_head.weight", torch.ones(6, 4))], group)
        with pytest.raises(SyncFailed, match="unknown parameter model.unknown"):
            await engine.receive_weights(WholeTensorTransport(TIMEOUT, 100), 1, group, TIMEOUT)
        kind, message, _ = await trainer.outcome()
        assert kind == "SyncFailed" and "rank 1: failed:" in message and "unknown parameter model.unknown" in message
        assert not torch.any(engine.engine.tokenizer_manager.weights["lm_head.weight"])
        trainer.close()

    asyncio.run(scenario())


def test_a_replica_that_cannot_join_fails_the_send_with_its_reason(monkeypatch, model_dir) -> None:
    _stand_in_sglang(monkeypatch)
    group = _group(epoch=5)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir, stand_in_fail_init="no NCCL here"), "cuda")
        # Its rendezvous would wait this long for the replica; the replica's reason ends it sooner (a loaded
        # machine once took over 30 s to get the replica that far).
        trainer = _Trainer(timeout=timedelta(seconds=90))
        trainer.send(1, [("lm_head.weight", torch.ones(6, 4))], group)
        with pytest.raises(SyncFailed, match="no NCCL here"):
            await engine.receive_weights(WholeTensorTransport(TIMEOUT, 100), 1, group, TIMEOUT)
        refused = time.monotonic()
        kind, message, kept = await trainer.outcome()
        assert (kind, kept) == ("SyncFailed", False) and "rank 1: failed:" in message and "no NCCL here" in message
        assert time.monotonic() - refused < 25, "rank 0 waited out its rendezvous instead of reading the reason"
        assert engine.weights.group is None
        trainer.close()

    asyncio.run(scenario())


def test_a_member_with_the_wrong_secret_never_reaches_sglang(monkeypatch, model_dir) -> None:
    _stand_in_sglang(monkeypatch)
    group = _group(epoch=4)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir), "cuda")
        trainer = _Trainer()
        trainer.send(1, [("lm_head.weight", torch.ones(6, 4))], replace(group, secret="another"))
        with pytest.raises(SyncFailed, match="rank 0 rejected"):
            await engine.receive_weights(WholeTensorTransport(TIMEOUT, 100), 1, group, TIMEOUT)
        kind, message, _ = await trainer.outcome()
        assert kind == "SyncFailed" and "wrong secret" in message
        assert engine.engine.tokenizer_manager.calls == [] and engine.weight_version == 0
        trainer.close()

    asyncio.run(scenario())


def test_the_checkpoint_transport_is_refused(monkeypatch, model_dir, tmp_path) -> None:
    _stand_in_sglang(monkeypatch)

    async def scenario():
        engine = await SglangEngine.create(_config(model_dir), "cuda")
        transport = CheckpointTransport(tmp_path / "weights", TIMEOUT)
        with pytest.raises(SyncFailed, match="weight_sync_transport=collective"):
            await engine.receive_weights(transport, 1, None, TIMEOUT)
        generated = await engine.generate("1", 1, DecodingParams())  # generations are not held off afterwards
        assert generated.weight_version == 0

    asyncio.run(scenario())
