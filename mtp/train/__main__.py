"""`python -m mtp.train +experiment=byte8`: see `mtp.train.run`."""

from mtp.train.run import main

if __name__ == "__main__":
    main()
