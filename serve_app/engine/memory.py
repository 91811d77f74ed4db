"""The peak memory of a pipeline call, as the engine reports it in `EngineOutput.peak_memory_mb`."""

from __future__ import annotations

import torch


class PeakMemory:
    """Peak device memory on CUDA; on CPU the growth of the process's peak RSS during the call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kind = "cuda" if device.type == "cuda" else "cpu_rss"
        self._base = 0

    def start(self) -> None:
        if self.kind == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:  # Linux: writing 5 resets VmHWM (the peak RSS) to the current RSS
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self._base = _proc_status_kb("VmRSS")

    def stop(self) -> float:
        if self.kind == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(0, _proc_status_kb("VmHWM") - self._base) / 1024


def _proc_status_kb(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
