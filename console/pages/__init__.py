"""The browser UI: the admin console (platform admins) and the customer portal, one module per area."""
