"""``python -m distlm.doctor``."""

from distlm.doctor.cli import run

if __name__ == "__main__":
    run()
