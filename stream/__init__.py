"""probewire.stream"""
