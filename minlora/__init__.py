"""minlora: LoRA (and DoRA) through ``torch.nn.utils.parametrize``, no change to the model's code; a
superset of cccntu/minLoRA, fixed, with :class:`LoRAConfig`, a fast forward, and minlora / PEFT files.
"""

from .adapters import (
    AdapterBaseMismatchError,
    AdapterFileError,
    NonFiniteAdapterError,
    base_fingerprint,
    load_adapter,
    save_adapter,
)
from .config import LoRAConfig
from .errors import LoRAFileNotFoundError, LoRAIndexError, LoRATypeError, LoRAValueError, MinloraError
from .model import (
    LoRAParametrization,
    LoRASite,
    add_lora,
    add_lora_by_name,
    apply_lora,
    default_lora_config,
    lora_sites,
    merge_lora,
    remove_lora,
)
from .peft import export_peft_adapter, import_peft_adapter
from .utils import (
    ParameterCount,
    apply_to_lora,
    count_parameters,
    disable_lora,
    enable_lora,
    get_bias_params,
    get_lora_params,
    get_lora_state_dict,
    get_params_by_name,
    load_multiple_lora,
    mark_only_lora_as_trainable,
    name_is_bias,
    name_is_lora,
    select_lora,
    set_fast_path,
    tie_weights,
    untie_weights,
)

__all__ = [
    # minLoRA's API
    "LoRAParametrization",
    "default_lora_config",
    "apply_lora",
    "add_lora",
    "add_lora_by_name",
    "merge_lora",
    "remove_lora",
    "apply_to_lora",
    "enable_lora",
    "disable_lora",
    "get_params_by_name",
    "get_lora_params",
    "get_bias_params",
    "get_lora_state_dict",
    "name_is_lora",
    "name_is_bias",
    "load_multiple_lora",
    "select_lora",
    "tie_weights",
    "untie_weights",
    # additions
    "LoRAConfig",
    "LoRASite",
    "lora_sites",
    "set_fast_path",
    "mark_only_lora_as_trainable",
    "count_parameters",
    "ParameterCount",
    "save_adapter",
    "load_adapter",
    "export_peft_adapter",
    "import_peft_adapter",
    "MinloraError",
    "LoRAValueError",
    "LoRAFileNotFoundError",
    "LoRATypeError",
    "LoRAIndexError",
    "AdapterFileError",
    "NonFiniteAdapterError",
    "AdapterBaseMismatchError",
    "base_fingerprint",
]
__version__ = "0.1.0"
