"""minlora: LoRA adapters through torch.nn.utils.parametrize (see issue: minlora)."""

from .config import LoRAConfig
from .model import (
    LoRAParametrization,
    add_lora,
    add_lora_by_name,
    apply_lora,
    default_lora_config,
    merge_lora,
    remove_lora,
)
from .utils import (
    apply_to_lora,
    count_parameters,
    disable_lora,
    enable_lora,
    get_bias_params,
    get_lora_params,
    get_lora_state_dict,
    load_multiple_lora,
    mark_only_lora_as_trainable,
    name_is_lora,
    select_lora,
    set_fast_path,
    tie_weights,
    untie_weights,
)
from .adapters import export_peft_adapter, import_peft_adapter, load_adapter, save_adapter
