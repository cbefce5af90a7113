"""Dashboard widgets: each renders one kind of planner result (no planner logic)."""
