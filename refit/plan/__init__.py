"""Pure planning: rosters, the merged parameter index and each rank's own transfer plan."""
