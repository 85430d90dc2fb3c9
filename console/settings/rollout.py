"""The autoscaler (rollout.autoscaler; each deployment's policy is its ``autoscale`` JSON).
Its tick and the canary controller's are beat entries (console/settings/celery.py)."""

from __future__ import annotations

from .env import envfloat, envint

#: Each replica's /metrics must answer within this, or it counts as not observed (seconds).
AUTOSCALER_SCRAPE_TIMEOUT = envfloat("AUTOSCALER_SCRAPE_TIMEOUT", 1.0)
# p99 latency is read over the usage records of AUTOSCALER_WINDOW_SECONDS, and only from
# AUTOSCALER_MIN_SAMPLES requests up (fewer: no latency verdict).
#: The window p99 latency is read over (seconds).
AUTOSCALER_WINDOW_SECONDS = envfloat("AUTOSCALER_WINDOW_SECONDS", 60.0)
#: Requests in the window needed for a latency verdict (a count).
AUTOSCALER_MIN_SAMPLES = envint("AUTOSCALER_MIN_SAMPLES", 20)
# Its busiest one counts.
#: The quiet period's load is judged in stretches this long (seconds).
AUTOSCALER_BUCKET_SECONDS = envint("AUTOSCALER_BUCKET_SECONDS", 30)
#: How often the autoscaler makes a pass over the deployments (seconds).
AUTOSCALER_TICK_SECONDS = envfloat("AUTOSCALER_TICK_SECONDS", 15.0)
#: Weeks of hourly usage rollups a predictive deployment's demand profile is read from.
AUTOSCALER_PREDICTIVE_WEEKS = envint("AUTOSCALER_PREDICTIVE_WEEKS", 4)
#: A predictive forecast's load time before a version's first replica has loaded (seconds).
AUTOSCALER_PREDICTIVE_LOAD_SECONDS = envfloat("AUTOSCALER_PREDICTIVE_LOAD_SECONDS", 300.0)
