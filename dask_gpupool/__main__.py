from dask_gpupool.ops.cli import main

if __name__ == "__main__":
    main()
