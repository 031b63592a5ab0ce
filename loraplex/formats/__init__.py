"""Adapter formats: readers, writers and validation of the converted LoRA adapter."""
from loraplex.formats.adapter import Adapter, AdapterMetadata, AdapterRow, content_hash
from loraplex.formats.detect import (FORMATS, detect_format, list_adapter_root, list_prefetch_dir,
                                     load_adapter, save_adapter)
from loraplex.formats.errors import (AdapterError, AdapterFormatError, AdapterTooLargeError,
                                     AdapterValidationError, BaseModelMismatchError, DtypeError,
                                     DuplicateRowError, EmptyAdapterError, LayerOutOfRangeError,
                                     ModuleNotEnabledError, NonFiniteError, PaddingError, RankError,
                                     RowShapeError, UnknownModuleError, UnsafeFileError,
                                     UnsupportedOptionError)
from loraplex.formats.llgtrt import read_llgtrt, write_llgtrt
from loraplex.formats.model_spec import ModelSpec
from loraplex.formats.modules import (HF_TO_MODULE_ID, MODULE_ID_TO_HF, MODULE_IDS, MODULE_NAMES,
                                      SERVED_MODULE_IDS, ModuleShape, module_shape)
from loraplex.formats.npy import read_npy_dir, write_npy_dir
from loraplex.formats.peft import read_peft, write_peft
from loraplex.formats.tensors import (STORAGE_DTYPES, adapter_from_tensors, cast_adapter,
                                      storage_dtype)
from loraplex.formats.validate import check_consistent, validate

__all__ = [
    "Adapter", "AdapterMetadata", "AdapterRow", "content_hash",
    "FORMATS", "detect_format", "load_adapter", "save_adapter", "list_adapter_root", "list_prefetch_dir",
    "AdapterError", "AdapterFormatError", "AdapterTooLargeError", "AdapterValidationError",
    "BaseModelMismatchError", "DtypeError", "DuplicateRowError", "EmptyAdapterError",
    "LayerOutOfRangeError", "ModuleNotEnabledError", "NonFiniteError", "PaddingError", "RankError",
    "RowShapeError", "UnknownModuleError", "UnsafeFileError", "UnsupportedOptionError",
    "read_llgtrt", "write_llgtrt", "read_npy_dir", "write_npy_dir", "read_peft", "write_peft",
    "ModelSpec", "HF_TO_MODULE_ID", "MODULE_ID_TO_HF", "MODULE_IDS", "MODULE_NAMES",
    "SERVED_MODULE_IDS", "ModuleShape", "module_shape",
    "STORAGE_DTYPES", "adapter_from_tensors", "cast_adapter", "storage_dtype", "validate", "check_consistent",
]
