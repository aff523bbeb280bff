"""LoRA adapters on a shared base: a layer's weight replaced by a
[`eqxscan.adapters.LoRA`][] that holds the frozen weight and `K` low-rank
adapters, inside a [`eqxscan.Stacked`][] stacked along the layer axis like any
other leaf, so that the base is never copied.
"""

from ._add import add_lora as add_lora, trainable as trainable
from ._lora import LoRA as LoRA
from ._merge import merge as merge, unmerge as unmerge
from ._peft import load_peft as load_peft, save_peft as save_peft
from ._select import select as select, with_dropout_key as with_dropout_key
