"""SGLang's control endpoints' request bodies (name -> JSON types accepted, None: null): the
weight-update group, weight loads, pause and abort, weight versions and memory release. The
/generate request and response are `protocol`'s."""

from __future__ import annotations

INIT_GROUP_FIELDS: dict[str, tuple[type | None, ...]] = {
    "master_address": (str,),
    "master_port": (int,),
    "rank_offset": (int,),
    "world_size": (int,),
    "group_name": (str,),
    "backend": (str,),
}
# What every weight load takes, however the weights arrive.
_LOAD_FIELDS: dict[str, tuple[type | None, ...]] = {
    "load_format": (str, None),
    "flush_cache": (bool,),
    "weight_version": (str, None),
    "abort_all_requests": (bool,),
}
UPDATE_DISTRIBUTED_FIELDS: dict[str, tuple[type | None, ...]] = {
    "names": (list,),
    "dtypes": (list,),
    "shapes": (list,),
    "group_name": (str,),
    **_LOAD_FIELDS,
}
UPDATE_TENSOR_FIELDS: dict[str, tuple[type | None, ...]] = {
    "serialized_named_tensors": (list,),
    **_LOAD_FIELDS,
}
UPDATE_DISK_FIELDS: dict[str, tuple[type | None, ...]] = {
    "model_path": (str,),
    **_LOAD_FIELDS,
    "is_async": (bool,),
    "torch_empty_cache": (bool,),
    "keep_pause": (bool,),
    "recapture_cuda_graph": (bool,),
    "token_step": (int,),
}
DESTROY_GROUP_FIELDS: dict[str, tuple[type | None, ...]] = {"group_name": (str,)}
PAUSE_FIELDS: dict[str, tuple[type | None, ...]] = {"mode": (str,)}
PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_FIELDS: dict[str, tuple[type | None, ...]] = {
    "rid": (str, None),
    "abort_all": (bool,),
    "finished_reason": (str, None),
    "abort_message": (str, None),
}
WEIGHT_VERSION_FIELDS: dict[str, tuple[type | None, ...]] = {
    "new_version": (str,),
    "abort_all_requests": (bool,),
}
MEMORY_FIELDS: dict[str, tuple[type | None, ...]] = {"tags": (list, None)}
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
# Every endpoint that changes weights or state answers this.
RESULT_FIELDS = ("success", "message")
