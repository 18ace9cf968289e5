"""A forward batch's request slots read on the host (the plugin attaches them to every forward
batch: ``tests/integration/test_plugin.py``) instead of ``req_pool_indices`` on the device."""

from __future__ import annotations

from types import SimpleNamespace

from redknot.attention.slots import request_slots


class _DeviceIndices:
    """``req_pool_indices`` standing in for a device tensor whose read-back is counted."""

    def __init__(self, values: list[int]) -> None:
        self.values = values
        self.shape = (len(values),)
        self.reads = 0

    def tolist(self) -> list[int]:
        self.reads += 1
        return list(self.values)


def test_the_host_copy_is_read_and_the_device_is_not():
    indices = _DeviceIndices([7, 3, 5])
    fb = SimpleNamespace(req_pool_indices=indices, redknot_req_slots=[7, 3, 5])
    assert request_slots(fb) == [7, 3, 5] and indices.reads == 0


def test_without_a_matching_host_copy_the_device_is_read():
    for slots in (None, [7, 3]):  # none attached; one of another batch's length
        indices = _DeviceIndices([7, 3, 5])
        fb = SimpleNamespace(req_pool_indices=indices, redknot_req_slots=slots)
        assert request_slots(fb) == [7, 3, 5] and indices.reads == 1
