"""Device ids: map the ids Backend.AI writes in ``resource.txt`` to telemetry devices, and label
every telemetry series with the id spelled as Backend.AI spells it on this node.

Plugins spell the same GPU differently (each plugin chooses its own device ids):

============================  ==============================================  ==============
plugin                        whole GPU                                        MIG device
============================  ==============================================  ==============
``cuda_open``                 CUDA ordinal ``"0"`` (assumed = NVML index)       —
fractional (commercial)       ``GPU-<uuid>``                                    ``MIG-<uuid>``
``mock``                      ``mother_uuid`` as configured (a bare uuid)        ``MIG-<mother_uuid>/<idx>/0``
============================  ==============================================  ==============

:class:`DeviceResolver` accepts all of them (case-insensitively, plus the pre-R470 MIG form
``MIG-GPU-<uuid>/<gi>/<ci>``). The ``device_id`` label of a whole GPU follows a *scheme*:
``index`` (``"0"``), ``uuid`` (``GPU-…``) or ``bare-uuid`` (``…`` without ``GPU-``). ``auto``
picks the spelling most allocation ids on this node use; with none to go by, ``uuid`` for NVML
and ``bare-uuid`` (the mock plugin's ``mother_uuid``) for mock devices. A MIG device is always
labelled with its own id (``MIG-…``), which is how every plugin writes it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from exporter.telemetry.model import DeviceReading, MigDeviceReading, TelemetrySnapshot

__all__ = ["DEVICE_ID_SCHEMES", "DeviceResolver"]

DEVICE_ID_SCHEMES = ("auto", "index", "uuid", "bare-uuid")
_GPU_PREFIX = "GPU-"


def _bare(uuid: str) -> str:
    return uuid[len(_GPU_PREFIX) :] if uuid.startswith(_GPU_PREFIX) else uuid


class DeviceResolver:
    """Resolves allocation device ids against one snapshot and labels its devices.

    Build one per scrape: it is cheap and reflects the snapshot's current inventory.

    :param snapshot: the telemetry whose devices are labelled.
    :param allocation_device_ids: device ids of GPU slots seen in ``resource.txt`` files; they
        decide the ``auto`` scheme (ids that match no device do not vote).
    :param scheme: ``auto``, ``index``, ``uuid`` or ``bare-uuid`` (``--device.id-scheme``).
    """

    def __init__(self, snapshot: TelemetrySnapshot, allocation_device_ids: Iterable[str] = (), scheme: str = "auto") -> None:
        if scheme not in DEVICE_ID_SCHEMES:
            raise ValueError(f"unknown device id scheme {scheme!r} (expected one of {', '.join(DEVICE_ID_SCHEMES)})")
        self._by_id: dict[str, DeviceReading | MigDeviceReading] = {}
        # Exact spellings first, so a UUID never loses to another device's index.
        for device in snapshot.devices:
            self._add(device.uuid, device)
            self._add(_bare(device.uuid), device)
        for device in snapshot.devices:
            for mig in device.mig_devices:
                self._add(mig.uuid, mig)
                if mig.gpu_instance_id is not None and mig.compute_instance_id is not None:
                    # The pre-R470 MIG UUID form, still accepted by CUDA_VISIBLE_DEVICES.
                    self._add(f"MIG-{device.uuid}/{mig.gpu_instance_id}/{mig.compute_instance_id}", mig)
        for device in snapshot.devices:
            if device.index is not None:
                self._add(str(device.index), device)
        self.scheme = scheme if scheme != "auto" else self._detect(snapshot, allocation_device_ids)

    def _add(self, key: str, device: DeviceReading | MigDeviceReading) -> None:
        self._by_id.setdefault(key.lower(), device)

    def _detect(self, snapshot: TelemetrySnapshot, ids: Iterable[str]) -> str:
        votes: Counter[str] = Counter()
        for device_id in ids:
            device = self.resolve(device_id)
            if not isinstance(device, DeviceReading):
                continue
            if device_id.isdigit():
                votes["index"] += 1
            elif device_id.upper().startswith(_GPU_PREFIX):
                votes["uuid"] += 1
            else:
                votes["bare-uuid"] += 1
        if votes:
            # Ties go to the unambiguous spellings.
            return max(("uuid", "bare-uuid", "index"), key=lambda s: votes[s])
        return "bare-uuid" if snapshot.source == "mock" else "uuid"

    def resolve(self, alloc_device_id: str) -> DeviceReading | MigDeviceReading | None:
        """The device an allocation id names, or None when this node has no such device."""
        return self._by_id.get(alloc_device_id.strip().lower())

    def label(self, device: DeviceReading | MigDeviceReading) -> str:
        """The ``device_id`` label value for a device."""
        if isinstance(device, MigDeviceReading):
            return device.uuid
        if self.scheme == "index" and device.index is not None:
            return str(device.index)
        if self.scheme == "bare-uuid":
            return _bare(device.uuid)
        return device.uuid

    def label_for_uuid(self, uuid: str) -> str:
        """The label of the device with this UUID; the UUID itself when it is not in the snapshot."""
        device = self.resolve(uuid)
        return self.label(device) if device is not None else uuid
