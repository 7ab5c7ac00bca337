"""ioaware simulator: hardware specs as data (``hardware``), the analytic cost model (``costs``), the tile
simulator (``tiles``), measurement on this machine (``measure``) and its calibrated spec (``calibrate``), the
report (``report``), the GPU check (``gpu_check``) and the command line (``cli``)."""
