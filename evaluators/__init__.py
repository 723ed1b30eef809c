"""probewire.evaluators"""
