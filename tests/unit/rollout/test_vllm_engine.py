"""Everything around vLLM's AsyncLLM, against a stand-in `vllm` module (vLLM itself cannot be installed here).

What is real: the job-config translation, the request and sampling
translation, the result mapping, env var passing, the refusal when vllm is
missing, and the worker extension's weight loading (a real checkpoint
transport into a real torch module through `load_weights`). What the stand-in
replaces: vLLM's scheduler and model execution.
"""

from __future__ import annotations

import asyncio
import sys
import types
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from dockyard.config import load_config_text
from dockyard.models import build_char_tokenizer
from dockyard.rpc.errors import FailedPrecondition
from dockyard.weights.transports import CheckpointTransport
from services.rollout.decoding import DecodingParams
from services.rollout.engine import UnsupportedRequest
from services.rollout.vllm_engine import (
    VllmEngine,
    VllmUnavailable,
    completion_from_vllm,
    engine_arguments,
    import_vllm,
)
from services.rollout.vllm_worker import WeightLoaderExtension


def _config(model_dir: str, **vllm_cfg) -> object:
    import yaml

    data = {
        "policy": {
            "model_name": model_dir,
            "dtype": "bfloat16",
            "generation": {"backend": "vllm", "vllm_cfg": vllm_cfg},
        },
        "cluster": {"device": "cuda", "weight_sync_backend": "nccl"},
        "grpo": {"seed": 5},
    }
    return load_config_text(yaml.safe_dump(data))


class _Model(torch.nn.Module):
    """What load_weights does in vLLM: take (checkpoint name, tensor) pairs and copy them in."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Parameter(torch.zeros(6, 4))
        self.head = torch.nn.Parameter(torch.zeros(4))
        self.loaded: list[str] = []

    def load_weights(self, weights):
        params = {"model.embed.weight": self.embed, "model.head.weight": self.head}
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            self.loaded.append(name)


class _Worker(WeightLoaderExtension):
    def __init__(self) -> None:
        self.model_runner = SimpleNamespace(model=_Model())
        self.device = torch.device("cpu")


class _FakeLLM:
    def __init__(self, args) -> None:
        self.args = args
        self.env_seen = dict(__import__("os").environ)
        self.workers = [_Worker()]
        self.requests: list = []
        self.prefix_resets = 0
        self.release = asyncio.Event()
        self.release.set()
        self.aborted: list[str] = []

    async def generate(self, prompt, params, request_id):
        self.requests.append((prompt, params, request_id))
        try:
            await self.release.wait()
        except asyncio.CancelledError:  # where AsyncLLM aborts the request
            self.aborted.append(request_id)
            raise
        ids = prompt["prompt_token_ids"]
        outputs = [
            SimpleNamespace(
                token_ids=[ids[0], 3],
                logprobs=[{ids[0]: SimpleNamespace(logprob=-0.5)}, {3: SimpleNamespace(logprob=-1.25)}],
                text="ab",
                finish_reason=reason,
                stop_reason=stop,
            )
            for reason, stop in [("length", None), ("stop", None), ("stop", "b")][: params.kwargs["n"]]
        ]
        yield SimpleNamespace(outputs=outputs[:1], finished=False)
        yield SimpleNamespace(outputs=outputs, finished=True)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [await asyncio.to_thread(getattr(w, method), *args) for w in self.workers]

    async def reset_prefix_cache(self):
        self.prefix_resets += 1

    def shutdown(self):
        self.workers = []


def _stand_in_vllm(monkeypatch) -> types.ModuleType:
    class Recorded:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = type("SamplingParams", (Recorded,), {})
    vllm.AsyncEngineArgs = type("AsyncEngineArgs", (Recorded,), {})
    async_llm = types.ModuleType("vllm.v1.engine.async_llm")
    async_llm.AsyncLLM = SimpleNamespace(from_engine_args=_FakeLLM)
    for name, module in {
        "vllm": vllm,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.async_llm": async_llm,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return vllm


@pytest.fixture()
def model_dir(tmp_path) -> str:
    build_char_tokenizer().save_pretrained(tmp_path)
    return str(tmp_path)


def test_missing_vllm_is_a_clear_failed_precondition(monkeypatch, model_dir) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(VllmUnavailable, match="backend=vllm: vLLM is not importable"):
        import_vllm()

    from dockyard.api.rollout.v1 import rollout_pb2
    from services.rollout.servicer import RolloutServicer
    from services.rollout.settings import RolloutSettings

    async def load():
        servicer = RolloutServicer(RolloutSettings())
        try:
            config = _config(model_dir).resolved_yaml()
            await servicer.LoadPolicy(rollout_pb2.LoadPolicyRequest(job_id="j", config_yaml=config), None)
        finally:
            await servicer.close()

    with pytest.raises(FailedPrecondition, match="install vllm there or use policy.generation.backend=torch"):
        asyncio.run(load())


def test_job_config_becomes_engine_arguments_and_worker_environment(model_dir) -> None:
    arguments, env = engine_arguments(
        _config(model_dir, gpu_memory_utilization=0.5, env_vars={"NCCL_NVLS_ENABLE": 0, "VLLM_X": "y"})
    )
    assert arguments == {
        "model": model_dir,
        "dtype": "bfloat16",
        "seed": 5,
        "worker_extension_cls": "services.rollout.vllm_worker.WeightLoaderExtension",
        "logprobs_mode": "processed_logprobs",
        "gpu_memory_utilization": 0.5,
    }
    assert env == {"NCCL_NVLS_ENABLE": "0", "VLLM_X": "y"}
    with pytest.raises(ValueError, match="logprobs_mode is set by the engine"):
        engine_arguments(_config(model_dir, logprobs_mode="raw_logprobs"))
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        engine_arguments(_config(model_dir, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="env_vars"):
        engine_arguments(_config(model_dir, env_vars=["A=1"]))


def test_generation_and_weight_loading_through_the_engine(monkeypatch, model_dir, tmp_path) -> None:
    _stand_in_vllm(monkeypatch)
    monkeypatch.delenv("DOCKYARD_TEST_WORKER_VAR", raising=False)

    async def scenario():
        engine = await VllmEngine.create(
            _config(model_dir, max_model_len=64, env_vars={"DOCKYARD_TEST_WORKER_VAR": "on"}), "cuda"
        )
        llm = engine.llm
        assert llm.env_seen["DOCKYARD_TEST_WORKER_VAR"] == "on"  # set before the workers start
        assert llm.args.kwargs["max_model_len"] == 64 and engine.num_parameters == 28

        sampling = DecodingParams(temperature=0.7, max_new_tokens=9, stop=("b",), ignore_eos=True, seed=4)
        result = await engine.generate("1+2=", 3, sampling)
        prompt, params, _ = llm.requests[0]
        assert prompt == {"prompt_token_ids": engine.tokenizer("1+2=")["input_ids"]}
        assert params.kwargs == {
            "n": 3,
            "temperature": 0.7,
            "max_tokens": 9,
            "stop": ["b"],
            "include_stop_str_in_output": True,
            "ignore_eos": True,
            "seed": 4,
            "logprobs": 0,
            "skip_special_tokens": True,
        }
        assert [c.finish_reason for c in result.completions] == ["length", "eos", "stop"]
        assert result.completions[0].logprobs == [-0.5, -1.25] and result.weight_versions == [0]
        with pytest.raises(UnsupportedRequest, match="sampling.top_p"):
            await engine.generate("1+2=", 1, DecodingParams(top_p=0.9))
        with pytest.raises(UnsupportedRequest, match="sampling.top_k"):
            await engine.generate("1+2=", 1, DecodingParams(top_k=5))

        # Weights reach the worker's load_weights by checkpoint name; the prefix cache is reset.
        transport = CheckpointTransport(tmp_path / "weights", timedelta(seconds=5))
        new = [("_orig_mod.model.embed.weight", torch.randn(6, 4)), ("model.head.weight", torch.randn(4))]
        sent = transport.send(new, version=2)
        llm.release.clear()  # hold a generation open: without in-flight updates the load waits for it
        generating = asyncio.create_task(engine.generate("1+2=", 1, DecodingParams()))
        await asyncio.sleep(0.05)
        loading = asyncio.create_task(engine.receive_weights(transport, 2, None, timedelta(seconds=5)))
        await asyncio.sleep(0.1)
        assert not loading.done()
        llm.release.set()
        report = await loading
        assert (await generating).weight_versions == [0]
        worker_model = llm.workers[0].model_runner.model
        assert report.checksum == sent.checksum and engine.weight_version == 2 and llm.prefix_resets == 1
        assert worker_model.loaded == ["model.embed.weight", "model.head.weight"]
        assert torch.equal(worker_model.embed, new[0][1]) and torch.equal(worker_model.head, new[1][1])
        await engine.close()

    asyncio.run(scenario())


def test_a_cancelled_generation_reaches_vllm(monkeypatch, model_dir) -> None:
    _stand_in_vllm(monkeypatch)

    async def scenario():
        engine = await VllmEngine.create(_config(model_dir), "cuda")
        llm = engine.llm
        llm.release.clear()
        generating = asyncio.create_task(engine.generate("1+2=", 1, DecodingParams()))
        while not llm.requests:
            await asyncio.sleep(0)
        generating.cancel()
        await asyncio.gather(generating, return_exceptions=True)
        assert generating.cancelled()
        assert llm.aborted == [llm.requests[0][2]]
        assert engine._active == 0  # a weight load no longer waits for it
        await engine.close()

    asyncio.run(scenario())


def test_unknown_finish_reason_is_an_error_not_a_guess() -> None:
    output = SimpleNamespace(token_ids=[], logprobs=[], text="", finish_reason="abort", stop_reason=None)
    with pytest.raises(RuntimeError, match="abort"):
        completion_from_vllm(output, (0,))
