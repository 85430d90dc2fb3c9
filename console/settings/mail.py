"""Email: invoices and budget alerts go to each organisation's billing_email.

The default writes every message as a file under $PLATFORM_VAR_DIR/mail/ (nothing leaves the
machine); EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend with EMAIL_HOST etc. sends them.
"""

from __future__ import annotations

import os

from core import embedded

from .env import envbool, envfloat, envint

#: Django's email backend (a dotted class path; default: files under EMAIL_FILE_PATH).
EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.filebased.EmailBackend")
#: Where the file backend writes messages (a folder).
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH", str(embedded.VAR_DIR / "mail"))
#: The SMTP server's host name.
EMAIL_HOST = os.environ.get("EMAIL_HOST", "localhost")
#: The SMTP server's port (a port number).
EMAIL_PORT = envint("EMAIL_PORT", 25)
#: The SMTP user name (a string; empty: no login).
EMAIL_HOST_USER = os.environ.get("EMAIL_HOST_USER", "")
#: The SMTP password (a string).
EMAIL_HOST_PASSWORD = os.environ.get("EMAIL_HOST_PASSWORD", "")
#: Whether SMTP uses STARTTLS (a bool).
EMAIL_USE_TLS = envbool("EMAIL_USE_TLS", "false")
#: Whether SMTP uses implicit TLS (a bool).
EMAIL_USE_SSL = envbool("EMAIL_USE_SSL", "false")
# A mail server that hangs must not hold a worker (alerts are retried, invoices too).
#: How long one SMTP operation may take (seconds).
EMAIL_TIMEOUT = envfloat("EMAIL_TIMEOUT", 10.0)
#: The sender of invoices and budget alerts (an address).
DEFAULT_FROM_EMAIL = os.environ.get("DEFAULT_FROM_EMAIL", "billing@localhost")
#: The sender of Django's error mails to admins (an address; = DEFAULT_FROM_EMAIL).
SERVER_EMAIL = DEFAULT_FROM_EMAIL
