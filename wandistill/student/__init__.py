"""The student room: config resolution, construction, lazy init from teacher blocks, losses.

A student is a plain diffusers `WanTransformer3DModel` with a smaller config, so the trained
weights drop into `WanPipeline(transformer=student)`. Nothing here reads the teacher's weights
except `init.init_from_teacher`, which opens only the tensors it copies, lazily. The
re-exports load on first use (`wandistill.runtime.lazy`): importing
`wandistill.student.schedule` does not import diffusers.
"""

from typing import TYPE_CHECKING

from wandistill.runtime.lazy import exports

if TYPE_CHECKING:
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
__getattr__, __dir__ = exports(
    __name__,
    {
        "check_against_cache": "wandistill.student.config",
        "resolve_student_config": "wandistill.student.config",
        "SigmaTable": "wandistill.student.losses",
        "distill_losses": "wandistill.student.losses",
        "flow_x0": "wandistill.student.losses",
        "DistillModule": "wandistill.student.model",
        "build_student": "wandistill.student.model",
    },
)
