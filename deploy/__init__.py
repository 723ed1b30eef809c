"""probewire.deploy"""
