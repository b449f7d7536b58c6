"""The elementwise linear recurrence (RG-LRU's scan): one state value per channel."""
