"""The role servers of a run, as the coordinator reaches them: their clients (``Roles``) and
their connection and initialization (``RoleServers``)."""
