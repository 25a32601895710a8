"""Profile stage: how long each distinct kernel of a trace takes on the target hardware.

``run_profile`` models GPU targets with a roofline (``roofline``) and times kernels on the local
CPU (``measure``, cached across workloads in ``cache``). ``STAGE_VERSION`` goes into the
workflow rule's ``params`` so that a change of this stage's logic re-runs it (DESIGN.md 1).
"""

from echo.profile.kernel import Kernel, Result
from echo.profile.stage import distinct_kernels, run_profile

STAGE_VERSION = "1"

__all__ = ["STAGE_VERSION", "Kernel", "Result", "distinct_kernels", "run_profile"]
