from normlab.cli import main

if __name__ == "__main__":  # not when a multiprocessing fork server imports the main module
    raise SystemExit(main())
