"""The student room: config resolution, construction, lazy init from teacher blocks, losses.

A student is a plain diffusers `WanTransformer3DModel` with a smaller config, so the trained
weights drop into `WanPipeline(transformer=student)`. Nothing here reads the teacher's weights
except `init.init_from_teacher`, which opens only the tensors it copies, lazily.
"""

from wandistill.student.config import check_against_cache, resolve_student_config
from wandistill.student.losses import SigmaTable, distill_losses, flow_x0
from wandistill.student.model import DistillModule, build_student

__all__ = [
    "DistillModule",
    "SigmaTable",
    "build_student",
    "check_against_cache",
    "distill_losses",
    "flow_x0",
    "resolve_student_config",
]
