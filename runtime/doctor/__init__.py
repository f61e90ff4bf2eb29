"""runtime.doctor: `specmoe doctor`, the one command a Mac user runs and pastes into an issue.

Owns: reading the machine (chip, RAM, GPU working set, SSD), MLX's version and backend, the
selfcheck status, host-sync latency with and without MLX's fast-synch, cold SSD reads at queue depth
1 and 4, decoding on the embedded pair at 100/50/25% plain and speculative with host syncs and
repairs per token, and the planner's projection beside the measurements.

Invariants kept at this boundary: a check that cannot run here is reported as skipped with its
reason, never faked; a failing check does not stop the others; the JSON report is what
`specmoe plan --from-doctor` reads.
"""

from runtime.doctor.render import render_report
from runtime.doctor.run import DOCTOR_VERSION, run_doctor
from runtime.doctor.ssd_probe import cold_read_gbps

__all__ = ["run_doctor", "render_report", "DOCTOR_VERSION", "cold_read_gbps"]
