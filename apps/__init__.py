"""Applications built on epic_rag (the demo chat server lives in apps.demo)."""
