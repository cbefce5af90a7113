"""Dashboard screens: Overview, Search, Plan, Export, Hardware, and the Help and Confirm modals."""
