"""ioaware simulator: hardware specs (``hardware``), the analytic cost model (``costs``), the tile simulator
(``tiles``), measurement on this machine (``measure``), the report (``report``) and the command line (``cli``)."""
