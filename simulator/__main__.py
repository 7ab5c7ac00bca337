from .cli import main

if __name__ == "__main__":  # (not when a spawned process of simulator.precompile imports it as __mp_main__)
    raise SystemExit(main())
