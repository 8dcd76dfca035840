"""The worker extension vLLM mixes into each of its GPU workers (`worker_extension_cls`).

    VllmEngine ──AsyncLLM.collective_rpc("dockyard_receive", transport spec, version, weight-sync group)──>
        every worker: transport (weight-sync group rank / checkpoint folder) ──whole tensors──>
        self.model_runner.model.load_weights(checkpoint names)

Guarantees: each worker keeps one transport (and so one weight-sync group membership)
across syncs and rebuilds it only when the spec changes; tensors reach vLLM's
own `load_weights` by checkpoint name (it fuses q/k/v and gate/up itself);
any failure resets the transport, so the next sync forms the coordinator's
next epoch. This module imports nothing from vLLM: the methods run on the
worker object vLLM builds (it provides `model_runner` and `device`).
"""

from __future__ import annotations

from typing import Any

from dockyard.weights.collective import TensorSink, WeightSyncGroup
from dockyard.weights.transports import Transport, transport_from_spec


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
        transport = self._dockyard_transport_for(spec)
        model = self.model_runner.model  # type: ignore[attr-defined]
        sink = TensorSink(load=lambda items: model.load_weights(weights=items), device=self.device)  # type: ignore[attr-defined]
        try:
            report = transport.receive(sink, version, WeightSyncGroup(**group) if group else None)
        except Exception:
            transport.reset()
            raise
        return {"checksum": report.checksum, "num_bytes": report.num_bytes, "seconds": report.seconds}

    def dockyard_reset(self) -> None:
        if self._dockyard_transport is not None:
            self._dockyard_transport.reset()

    def dockyard_num_parameters(self) -> int:
        return sum(p.numel() for p in self.model_runner.model.parameters())  # type: ignore[attr-defined]
