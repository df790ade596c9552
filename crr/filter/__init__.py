"""The determinism filter: only tasks whose held-out tests replay identically enter training."""

from crr.filter.determinism import (ADMITTED, DISCARDED, INFRA_ERROR, FilterConfig, Summary, check_task,
                                    discard_table, filter_config, filter_tasks, open_run, write_outputs)

__all__ = ["ADMITTED", "DISCARDED", "INFRA_ERROR", "FilterConfig", "Summary", "check_task", "discard_table",
           "filter_config", "filter_tasks", "open_run", "write_outputs"]
