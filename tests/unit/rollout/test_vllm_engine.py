"""The parts of the vLLM engine that need no vLLM: config translation, refusals, the logprob wrap, result mapping.

Generation, weight loading, seeds, stop strings, eos, token-id prompts and
worker environments run against real vLLM in tests/integration/test_vllm_engine.py.
What stays here runs before vLLM is reached or without it: the refusal when
vLLM is missing, the job-config translation (tensor_parallel_size passes
through; pipeline and data parallelism inside one engine are refused by the
engine itself: no vLLM run is needed to show it), the sampler-stage wrap on
plain tensors, and an unknown finish reason.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest
import torch

from dockyard.config import load_config_text
from dockyard.models import build_char_tokenizer
from dockyard.rpc.errors import FailedPrecondition
from services.rollout.decoding import DecodingParams
from services.rollout.engine import ImagePrompt, UnsupportedRequest
from services.rollout.vllm_engine import VllmEngine, VllmUnavailable, engine_arguments, import_vllm, vllm_sampling
from services.rollout.vllm_outputs import completion_from_vllm
from services.rollout.vllm_worker import WeightLoaderExtension, untruncated


def _config(model_dir: str, device: str = "cpu", **vllm_cfg) -> object:
    import yaml

    data = {
        "policy": {
            "model_name": model_dir,
            "dtype": "bfloat16",
            "generation": {"backend": "vllm", "vllm_cfg": vllm_cfg},
        },
        "cluster": {"device": device, "weight_sync_backend": "nccl" if device == "cuda" else "gloo"},
        "grpo": {"seed": 5},
    }
    return load_config_text(yaml.safe_dump(data))


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

    # The way this project installs vLLM (its CPU build, an extra of the clone), not a bare `pip install vllm`.
    fix = "on CPU `make install-vllm`, the vllm extra; on a GPU node CUDA vLLM.*backend=torch"
    with pytest.raises(FailedPrecondition, match=fix):
        asyncio.run(load())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_job_config_becomes_engine_arguments_and_worker_environment(model_dir, device) -> None:
    arguments, env = engine_arguments(
        _config(model_dir, device, gpu_memory_utilization=0.5, env_vars={"NCCL_NVLS_ENABLE": 0, "VLLM_X": "y"})
    )
    assert arguments == {
        "model": model_dir,
        "dtype": "bfloat16",
        "seed": 5,
        "worker_extension_cls": "services.rollout.vllm_worker.WeightLoaderExtension",
        "logprobs_mode": "processed_logprobs",
        "gpu_memory_utilization": 0.5,
    }
    assert env == {"NCCL_NVLS_ENABLE": "0", "VLLM_X": "y", "VLLM_USE_V2_MODEL_RUNNER": "0"}
    with pytest.raises(ValueError, match="logprobs_mode is set by the engine"):
        engine_arguments(_config(model_dir, logprobs_mode="raw_logprobs"))
    with pytest.raises(ValueError, match="env_vars.VLLM_USE_V2_MODEL_RUNNER is set by the engine"):
        engine_arguments(_config(model_dir, env_vars={"VLLM_USE_V2_MODEL_RUNNER": "1"}))
    # Tensor parallelism goes to vLLM as given (the driver worker relays the weights); one engine is one stage.
    assert engine_arguments(_config(model_dir, device, tensor_parallel_size=2))[0]["tensor_parallel_size"] == 2
    for field in ("pipeline_parallel_size", "data_parallel_size"):
        with pytest.raises(ValueError, match=rf"^policy.generation.vllm_cfg.{field}: only 1 is supported"):
            engine_arguments(_config(model_dir, **{field: 2}))
    with pytest.raises(ValueError, match="env_vars"):
        engine_arguments(_config(model_dir, env_vars=["A=1"]))


def _truncating_stage(logits, generators, k, p):
    """What vLLM's top-k/top-p stage does: mask in place, sample, report logprobs of the truncated logits."""
    if k is not None:
        kth = logits.topk(int(k[0]), dim=-1).values[:, -1:]
        logits.masked_fill_(logits < kth, float("-inf"))
    return logits.argmax(-1), logits.log_softmax(-1)


def test_the_wrapped_stage_reports_logprobs_before_truncation() -> None:
    logits = torch.randn(3, 11)
    expected = logits.log_softmax(-1)
    sampled, logprobs = untruncated(_truncating_stage)(logits.clone(), {}, torch.tensor([4, 4, 4]), None)
    torch.testing.assert_close(logprobs, expected)
    assert torch.equal(sampled, expected.argmax(-1))  # sampling still goes through the stage
    # The stage's own logprobs are of the truncated distribution: larger at the kept tokens.
    _, truncated = _truncating_stage(logits.clone(), {}, torch.tensor([4, 4, 4]), None)
    assert (truncated.gather(1, sampled[:, None]) > logprobs.gather(1, sampled[:, None])).all()
    # Nothing to truncate: the stage answers itself.
    calls = []
    untruncated(lambda *args: calls.append(args) or ("s", "l"))(logits, {}, None, None)
    assert len(calls) == 1


def test_a_worker_without_the_v1_sampler_refuses_rather_than_report_other_logprobs() -> None:
    worker = WeightLoaderExtension()
    worker.model_runner = SimpleNamespace(sampler=SimpleNamespace(logprobs_mode="raw_logprobs"))
    with pytest.raises(RuntimeError, match="cannot report logprobs before truncation"):
        worker.dockyard_untruncated_logprobs()
    stage = SimpleNamespace(forward=_truncating_stage)
    worker.model_runner = SimpleNamespace(
        sampler=SimpleNamespace(logprobs_mode="processed_logprobs", topk_topp_sampler=stage)
    )
    worker.dockyard_untruncated_logprobs()
    wrapped = stage.forward
    worker.dockyard_untruncated_logprobs()  # a second call wraps nothing twice
    assert stage.forward is wrapped and wrapped is not _truncating_stage


def test_unknown_finish_reason_is_an_error_not_a_guess() -> None:
    output = SimpleNamespace(token_ids=[], logprobs=[], text="", finish_reason="abort", stop_reason=None)
    with pytest.raises(RuntimeError, match="abort"):
        completion_from_vllm(output, (0,))
    stopped = SimpleNamespace(
        token_ids=[4, 5], logprobs=[{4: SimpleNamespace(logprob=-0.5)}, {5: SimpleNamespace(logprob=-1.0)}]
    )
    completion = completion_from_vllm(
        SimpleNamespace(**vars(stopped), text="ab", finish_reason="stop", stop_reason="b"), (0,)
    )
    assert completion[:6] == ([4, 5], [-0.5, -1.0], "ab", "stop", (0,), [])
    assert completion.routing is None and completion.prompt_routing is None  # vLLM's routing is not captured
    assert (
        completion_from_vllm(
            SimpleNamespace(**vars(stopped), text="ab", finish_reason="stop", stop_reason=None), (1,)
        ).finish_reason
        == "eos"
    )


def test_top_logprobs_are_each_steps_k_most_likely_of_vllms_entries() -> None:
    """vLLM returns its top k plus the sampled token (with its own rank) per step: the k most likely are kept,
    most likely first, whether or not the sampled token is among them."""
    entry = lambda logprob, rank: SimpleNamespace(logprob=logprob, rank=rank)  # noqa: E731
    steps = [
        {9: entry(-3.0, 7), 4: entry(-0.2, 1), 5: entry(-1.1, 2)},  # sampled 9 ranks 7th: not among the top 2
        {5: entry(-0.7, 1), 4: entry(-0.9, 2)},  # sampled 5 is the most likely
    ]
    output = SimpleNamespace(token_ids=[9, 5], logprobs=steps, text="", finish_reason="length", stop_reason=None)
    completion = completion_from_vllm(output, (0,), top_logprobs=2)
    assert completion.logprobs == [-3.0, -0.7]
    assert completion.top_logprobs == [([4, 5], [-0.2, -1.1]), ([5, 4], [-0.7, -0.9])]
    assert completion_from_vllm(output, (0,)).top_logprobs == []
    # The request asks vLLM for exactly that many.
    vllm = SimpleNamespace(
        SamplingParams=lambda **kw: kw,
        sampling_params=SimpleNamespace(RequestOutputKind=SimpleNamespace(FINAL_ONLY="final")),
    )
    assert vllm_sampling(vllm, 2, DecodingParams(top_logprobs=3))["logprobs"] == 3
    assert vllm_sampling(vllm, 2, DecodingParams())["logprobs"] == 0


def test_more_alternatives_than_vllms_max_logprobs_are_refused_by_name() -> None:
    engine = object.__new__(VllmEngine)  # no vLLM needed: the refusal comes before any engine call
    engine.llm = SimpleNamespace(model_config=SimpleNamespace(max_logprobs=5))
    engine.tokenizer, engine.vocab_size = build_char_tokenizer(), 100
    with pytest.raises(UnsupportedRequest, match=r"^top_logprobs: .*at most 5 .*vllm_cfg.max_logprobs.*got 6"):
        asyncio.run(engine.generate([5, 6], 1, DecodingParams(top_logprobs=6)))


def test_image_prompts_are_refused_by_name() -> None:
    from PIL import Image

    engine = object.__new__(VllmEngine)  # no vLLM needed: the refusal comes before any engine call
    assert "vLLM engine takes no image inputs" in engine.image_refusal
    with pytest.raises(UnsupportedRequest, match="images: the vLLM engine takes no image inputs"):
        engine.prompt_ids(ImagePrompt(text="x", images=(Image.new("RGB", (2, 2)),)))
