"""probewire.instrument"""
