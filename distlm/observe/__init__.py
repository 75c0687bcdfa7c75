"""Seeing inside a run: trackers, --log-file, the profiler window and straggler statistics."""

from distlm.observe.observer import Observer, check_observe_settings, start_log_file, stop_log_file

__all__ = ["Observer", "check_observe_settings", "start_log_file", "stop_log_file"]
