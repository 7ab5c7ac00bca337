"""Hardware specs as data: datasheet presets (TOML beside this package) and user TOML files. This machine's spec
is measured, not read: ``simulator.calibrate.cpu_spec()``."""
from .spec import HardwareSpec, from_toml, load, preset_names, replace

__all__ = ["HardwareSpec", "from_toml", "load", "preset_names", "replace"]
