"""The report: measured and predicted sections, CSV first, charts drawn from the CSV, then ``index.md`` and a
self-contained ``index.html`` in a run directory built atomically. Later features (int8, SnapKV) add their
section functions to ``SECTIONS``."""
from .int8 import int8_section
from .kvcache import kvcache_section
from .model import model_section
from .passkey import passkey_section
from .core import (RunContext, Section, build_report, default_out_dir, markdown_to_html, planned_steps, read_csv,
                   write_csv)
from .measured import ATTN_SIZES, attention_cpu_section, attention_flops, machine_section
from .predicted import (across_hardware_rows, across_hardware_section, bytes_by_tensor_section, roofline_section,
                        sram_sweep_section)
from .validation import validation_section

SECTIONS = (machine_section, attention_cpu_section, bytes_by_tensor_section, sram_sweep_section, roofline_section,
            across_hardware_section, validation_section, int8_section, kvcache_section, model_section, passkey_section)

__all__ = ["ATTN_SIZES", "RunContext", "SECTIONS", "Section", "across_hardware_rows", "attention_flops",
           "build_report", "default_out_dir", "markdown_to_html", "planned_steps", "read_csv", "write_csv"]
