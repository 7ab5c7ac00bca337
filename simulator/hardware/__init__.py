"""Hardware specs: datasheet presets (TOML beside this package), user TOML files, and this machine (``cpu``)."""
from .cpu import calibrate, cpu_spec
from .spec import HardwareSpec, from_toml, load, preset_names, replace

__all__ = ["HardwareSpec", "calibrate", "cpu_spec", "from_toml", "load", "preset_names", "replace"]
