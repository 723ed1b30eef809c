"""probewire.sinks"""
