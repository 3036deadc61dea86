"""Routing rules shared by the app's request routers and the capacity planner (`mmserve.routing.affinity`)."""
