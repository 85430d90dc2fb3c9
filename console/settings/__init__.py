"""Settings for the inference platform, configured from the environment, one module per subsystem.

``DJANGO_SETTINGS_MODULE=console.settings`` reads this package, which imports every module
below. A new setting goes in its subsystem's module with a ``#:`` line above it saying what it
is and its unit, read through the helpers in ``env.py``; a setting derived from another
imports that one from its module. A new subsystem gets a module of its own, imported here.

- ``base``: the Django project: apps, middleware, templates, i18n, static, DRF and OpenAPI, logging
- ``security``: PLATFORM_ENV, SECRET_KEY, hosts, HTTPS headers, passwords and sign-in
- ``services``: PostgreSQL and Redis (database, cache, Channels layer, key namespace)
- ``celery``: the broker, queues, task routes and the beat schedule
- ``artifacts``: the artifact store and artifact uploads
- ``gateway``: the data plane: engine client, bodies, routing, circuits, backpressure, /metrics
- ``batches``: the Files API, batch jobs and webhooks
- ``semcache``: the semantic cache and the embeddings' exact-match cache
- ``supervisor``: engine workers (runworkers), vLLM and small-model replicas
- ``predict``: small models' predictions over the Open Inference Protocol (HTTP and gRPC)
- ``rollout``: the autoscaler
- ``billing``: currency, invoices, usage persistence, the platform's organisation
- ``mail``: email (invoices and budget alerts)
"""

# In this order, not sorted: the checks of the configuration (security: PLATFORM_ENV, DEBUG,
# SECRET_KEY) run before any other module is read, as they did in the one file.
# isort: off
from .base import *  # noqa: F403
from .security import *  # noqa: F403
from .services import *  # noqa: F403
from .celery import *  # noqa: F403
from .artifacts import *  # noqa: F403
from .gateway import *  # noqa: F403
from .batches import *  # noqa: F403
from .semcache import *  # noqa: F403
from .supervisor import *  # noqa: F403
from .predict import *  # noqa: F403
from .rollout import *  # noqa: F403
from .billing import *  # noqa: F403
from .mail import *  # noqa: F403
# isort: on
