"""Profile stage: how long each distinct kernel of a trace takes on the target hardware.

``run_profile`` models GPU targets with a roofline (``roofline``, its per-GPU parameters fitted by
``echo.fit`` to published measurements), times kernels on the local CPU (``measure``, rebuilding
each call with ``rebuild``, cached across workloads in ``cache``; scaled to their in-loop time by
``inloop``, and charged DTensor's host dispatch time measured by ``host``), and imports durations
from a PyTorch profiler trace of a real run when one is given (``kineto``; ``realrun`` records one
here).
"""

from echo.profile.kernel import Kernel, Result
from echo.profile.stage import distinct_kernels, run_profile

__all__ = ["Kernel", "Result", "distinct_kernels", "run_profile"]
